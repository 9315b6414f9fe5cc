"""The console's pages, one module per resource, all under /console (see loramux.console)."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from loramux.console.deps import CsrfRejected, Operator, SignInRequired, render
from loramux.console.routes import adapters, auth, engine, prices, tenants, usage

# resolve(): in the development install this module is a link, and StaticFiles serves no file whose real path
# lies outside its directory.
STATIC = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(prefix="/console", include_in_schema=False)
for _page in (auth, tenants, adapters, prices, usage, engine):
    router.include_router(_page.router)


@router.get("")
def home(operator: Operator):
    return RedirectResponse("/console/tenants", status_code=303)


def install_console(app: FastAPI) -> None:
    """Mount the console on the server's app: its routes, static files and the handlers of its refusals.
    The app's startup sets `app.state.console_signer` (loramux.console.session.SessionSigner)."""
    app.include_router(router)
    app.mount("/console/static", StaticFiles(directory=str(STATIC)), name="console-static")

    @app.exception_handler(SignInRequired)
    async def sign_in(request: Request, exc: SignInRequired) -> Response:
        if request.method == "GET" and "/data" not in request.url.path and "/export" not in request.url.path:
            return RedirectResponse("/console/login", status_code=303)
        return JSONResponse({"error": {"message": "sign in at /console/login", "code": "signed_out"}},
                            status_code=401)

    @app.exception_handler(CsrfRejected)
    async def csrf(request: Request, exc: CsrfRejected) -> Response:
        return render(request, "error.html", None, status_code=403,
                      message="This form has expired or did not come from the console (CSRF check failed). "
                              "Reload the page and try again.")
