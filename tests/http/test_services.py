"""The service layer on its own, with plain arguments and no HTTP: what the admin API, the console and the CLI
share. (Through HTTP the same operations are tested in test_admin_api.py, test_console.py and test_billing_http.py.)"""
from __future__ import annotations

import pytest

from conftest import live_stack
from loramux.services import admin_keys, tenants
from loramux.services.adapters import UploadError, check_upload_fields
from loramux.tenancy.admin_keys import AdminKeyError, AdminKeys
from loramux.tenancy.tenants import KeyNotFoundError, Tenancy, TenancyError, TenantNotFoundError

ADMIN_KEY = "lmxa-test-services-key-0123456789abcdefghijk"


def test_tenant_keys_are_issued_rotated_and_revoked_by_id_or_name(database):
    tenancy = Tenancy(database)
    tenant = tenants.create_tenant(tenancy, "svc-co", "standard")
    issued = tenants.issue_key(tenancy, "svc-co")  # by name
    assert issued.key.startswith("lmx-") and issued.revoked is None and tenancy.authenticate(issued.key)
    rotated = tenants.rotate_key(tenancy, tenant.id, issued.id)  # by id
    assert rotated.revoked.id == issued.id and rotated.revoked.revoked_at is not None
    assert tenancy.authenticate(issued.key) is None and tenancy.authenticate(rotated.key).tenant_id == tenant.id
    assert [k.id for k in tenants.list_keys(tenancy, "svc-co")] == [issued.id, rotated.id]
    assert tenants.revoke_key(tenancy, "svc-co", rotated.id).revoked_at is not None
    with pytest.raises(KeyNotFoundError):
        tenants.revoke_key(tenancy, "svc-co", "key_nope")
    with pytest.raises(TenantNotFoundError):
        tenants.issue_key(tenancy, "nobody")
    with pytest.raises(TenancyError, match="needs a name"):
        tenants.create_tenant(tenancy, "")
    assert tenants.update_tenant(tenancy, "svc-co", status="suspended").status == "suspended"


def test_an_admin_key_cannot_revoke_itself(database):
    keys = AdminKeys(database)
    first, second = admin_keys.create_admin_key(keys, "one"), admin_keys.create_admin_key(keys, "two")
    with pytest.raises(admin_keys.SelfRevocationError, match="cannot revoke itself"):
        admin_keys.revoke_admin_key(keys, first.id, acting_key_id=first.id)
    assert admin_keys.revoke_admin_key(keys, first.id, acting_key_id=second.id).revoked_at is not None
    with pytest.raises(AdminKeyError):
        admin_keys.revoke_admin_key(keys, "ak_nope", acting_key_id=second.id)


@pytest.mark.parametrize("fields, message", [
    ({"name": "a"}, "missing form field(s): tenant_id"),
    ({"tenant_id": "t", "name": "a\ud800"}, "form fields must be valid Unicode text"),
    ({"tenant_id": "t", "name": "a", "allow_base_mismatch": "maybe"}, "allow_base_mismatch must be true or false"),
])
def test_upload_fields_are_refused_by_name(fields, message):
    with pytest.raises(UploadError, match=message.replace("(", r"\(").replace(")", r"\)")) as refused:
        check_upload_fields(fields)
    assert refused.value.status == 400


def test_service_errors_keep_their_http_answers(tiny_dir, tokenizer, tmp_path):
    """The errors the service layer raises instead of HTTP types map to the answers the routes gave before."""
    with live_stack(tmp_path, tiny_dir, tokenizer, client=True, admin_key=ADMIN_KEY, auth_failures_per_min=0) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        own = next(k for k in client.get("/admin/keys").json()["keys"] if k["revoked_at"] is None)
        itself = client.delete(f"/admin/keys/{own['id']}")
        assert itself.status_code == 400 and itself.json()["error"]["code"] == "invalid_request"
        assert "cannot revoke itself" in itself.json()["error"]["message"]
        upload = client.post("/admin/adapters", data={"name": "x"}, files={
            "adapter_config": ("adapter_config.json", b"{}"), "adapter_model": ("adapter_model.safetensors", b"")})
        assert upload.status_code == 400 and upload.json()["error"]["code"] == "upload_rejected"
        assert "missing form field(s): tenant_id" in upload.json()["error"]["message"]
