"""Sphinx configuration: the guides and design notes (Markdown, through MyST) and the API reference (autodoc).

Built strictly by the test suite (tests/test_docs.py): ``python -m sphinx -W -n -b html docs OUT``.
"""

project = "fabric_multimodel"
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Every reference must resolve (-n), except into the libraries the API is written against, whose documentation is
# not built here.
nitpicky = True
_outside = (
    r"torch|nn|lightning|lightning_fabric|pytorch_lightning|collections|typing|types|datetime|os|pathlib|numpy|argparse"
    r"|ssl"
)
nitpick_ignore_regex = [
    (r"py:.*", rf"({_outside})(\..*)?"),
    # what the signatures are written against, by the names they are imported as
    (r"py:class", r"Fabric|ProcessGroup|Optimizer|HasDevice|Modules|Path|Tensor|(dist\.)?Store|dist\.Work|timedelta"),
    (r"py:class", r".*\._T"),
    # the round kinds are internal (what the Averager builds), documented in the design notes, not here
    (r"py:class", r"fabric_multimodel\.rounds\..*"),
]
# A builtin type in a signature (``bytes``) that is also an attribute's name (``Traffic.bytes``) is "more than one
# target": Sphinx's, not a broken reference.
suppress_warnings = ["ref.python"]
html_theme = "alabaster"


def _google_sections(app, what, name, obj, options, lines):  # type: ignore[no-untyped-def]
    """Napoleon's reading of ``Args:`` and ``Returns:``, for functions and classes only: an attribute's or a
    property's docstring is prose, where napoleon would read "Seconds spent: ..." as a type and a description."""
    from sphinx.ext.napoleon import Config, GoogleDocstring

    if what not in ("attribute", "property", "data"):
        lines[:] = GoogleDocstring(lines, Config(napoleon_use_rtype=False), app, what, name, obj, options).lines()


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("autodoc-process-docstring", _google_sections)
