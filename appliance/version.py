"""The software's version: a leaf every layer may read (the page, status, reports, the CLI),
so none of them reaches up to the package face for it."""

__version__ = "0.1.0"
