"""Command-line arguments sphinx-gallery gives every example: the small CPU run."""


def small_run(gallery_conf, script_vars):
    return ["--small"]
