"""Sphinx configuration of the course's website (``make site``; docs/build.py stages the pages).

Sphinx with MyST-NB and the Sphinx Book Theme: the notebooks are rendered with their committed
outputs (never executed), and every page works offline (MathJax is served from the site itself).
"""

import json
from pathlib import Path

# written by docs/build.py next to this file: the repository's URL, once the Colab badges say it
context = json.loads((Path(__file__).parent / "_context.json").read_text())

project = "gradsync-tutorial"
html_title = "gradsync-tutorial"
author = "the gradsync-tutorial authors"
copyright = "the gradsync-tutorial authors (MIT)"

extensions = [
    "myst_nb",                 # notebooks (and markdown) as pages
    "sphinx-mathjax-offline",  # MathJax from _static/mathjax, not from a CDN
]
exclude_patterns = ["_context.json", "**/.ipynb_checkpoints"]
# docs/build.py runs Sphinx with -W: every warning fails the build (a broken link, a missing
# image), except a skipped heading level (H1 then H3), which JupyterLab and GitHub show fine
suppress_warnings = ["myst.header"]

# the notebooks as committed: outputs from their full-mode run, no re-execution
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath"]  # $...$ as in JupyterLab
myst_heading_anchors = 3  # README.md#quickstart-style links resolve

html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_copy_source = False  # the pages' sources are staged copies: the repository has the originals
html_show_sourcelink = False
html_last_updated_fmt = None
html_favicon = "_static/favicon.svg"  # (without one, browsers ask for /favicon.ico: a 404)
html_context = {"default_mode": "auto"}  # light or dark, as the reader's system is
html_theme_options = {
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "navigation_with_keys": False,
}
if context["repository_url"]:
    html_theme_options.update(repository_url=context["repository_url"],
                              use_repository_button=True)
