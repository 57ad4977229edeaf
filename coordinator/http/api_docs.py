"""/docs (Swagger UI) and /redoc served from the package, not from a CDN: the assets come from the
pinned fastapi-offline wheel (its static/ folder: swagger-ui-bundle.js, swagger-ui.css,
redoc.standalone.js), so the pages work on a machine without internet access."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs-assets"


def assets_dir() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


def mount_docs(app: FastAPI) -> None:
    """Call on an app created with docs_url=None, redoc_url=None."""
    app.mount(ASSETS, StaticFiles(directory=assets_dir()), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API",
                              redoc_js_url=f"{ASSETS}/redoc.standalone.js", redoc_favicon_url=f"{ASSETS}/favicon.png",
                              with_google_fonts=False)
