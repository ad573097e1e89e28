"""The local status page: a Flask blueprint serving ``/`` and its static assets.

The page is one HTML shell plus one script and one stylesheet, all served by the device
(devices sit on offline LANs: no CDN, no build step). Everything it shows comes from
``/api/status``, polled every 2 s; the script builds the DOM with ``textContent`` only,
so strings from models, configs or the bucket are never parsed as markup.

``create_app`` registers ``bp`` when this package is importable; nothing else is public.
"""

from __future__ import annotations

from flask import Blueprint, Response, render_template, request

__all__ = ["bp"]

bp = Blueprint("ui", __name__, static_folder="static", static_url_path="/ui/static",
               template_folder="templates")

# No inline script and no foreign origin: even a crafted string that somehow reached the
# DOM as markup could neither run nor load anything.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")


@bp.get("/")
def index() -> str:
    """The status page shell; ``status.js`` fills it from ``/api/status``."""
    from appliance.version import __version__  # the page header shows which software build serves it

    return render_template("status.html", version=__version__)


@bp.after_request
def _headers(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    # The shell is revalidated each load; assets are cached briefly so an upgrade shows soon.
    response.headers["Cache-Control"] = "public, max-age=60" if request.endpoint == "ui.static" else "no-cache"
    return response
