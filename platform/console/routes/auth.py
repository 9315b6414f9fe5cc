"""Sign in with an admin key (/console/login), and sign out."""
from __future__ import annotations

import secrets

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse

from loramux.console.deps import Operator, render, signer
from loramux.console.session import COOKIE, cookie_options, csrf_matches
from loramux.server.ingress import Refusal, resolve_admin

router = APIRouter()

LOGIN_COOKIE = "loramux_console_login"  # the sign-in form's CSRF token (double submit: cookie and field)


def _login_page(request: Request, message: str | None = None, status_code: int = 200):
    token = secrets.token_urlsafe(24)
    response = render(request, "login.html", None, status_code=status_code, login_csrf=token, message=message)
    response.set_cookie(LOGIN_COOKIE, token, max_age=900, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", path="/console/login")
    return response


@router.get("/login")
def login_form(request: Request):
    return _login_page(request)


@router.post("/login")
async def login(request: Request, admin_key: str = Form(""), csrf_token: str = Form("")):
    expected = request.cookies.get(LOGIN_COOKIE)
    if not expected or not secrets.compare_digest(expected, csrf_token):
        return _login_page(request, "The sign-in form expired or did not come from this page; try again.", 403)
    admin = await resolve_admin(request.app.state.services, admin_key.strip() or None)
    if isinstance(admin, Refusal):
        text = ("Tenant API keys cannot sign in to the console: use an admin key (lmxa-...)."
                if admin.status == 403 else "That admin key is unknown or revoked.")
        return _login_page(request, text, 401 if admin.status == 401 else 403)
    cookie, _ = signer(request).issue(admin.id)
    response = RedirectResponse("/console/tenants", status_code=303)
    response.set_cookie(value=cookie, **cookie_options(signer(request).max_age_s, request.url.scheme == "https"))
    response.delete_cookie(LOGIN_COOKIE, path="/console/login")
    return response


@router.post("/logout")
async def logout(request: Request, operator: Operator):
    form = await request.form()
    response = RedirectResponse("/console/login", status_code=303)
    if csrf_matches(operator[0], form.get("csrf_token")):
        response.delete_cookie(COOKIE, path="/console")
    return response
