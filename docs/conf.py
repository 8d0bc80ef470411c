"""Sphinx configuration: the guide is MyST Markdown (as JAX, Flax and optax
write theirs); the API page is read from the docstrings."""

project = "jaxmem"
author = "the jaxmem authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_typehints = "none"
napoleon_google_docstring = True
html_theme = "alabaster"
