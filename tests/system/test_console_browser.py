"""The operator console end to end in headless Chromium (Debian's `chromium`, driven by Playwright): an
operator signs in, creates a tenant and a key, uploads an adapter (and a pickle, refused), sets a price,
the tenant sends requests with the `openai` client, the operator sees spend and residency change, exports
CSV and reconciles it with the API's summary, revokes the key, and the tenant's next request is refused.

Screenshots of every page (1280x800, and the narrow layout) go to `test-artifacts/console/`
(LORAMUX_TEST_ARTIFACTS overrides); docs/console-*.png are three of them, shown in docs/admin-and-billing.md.
"""
from __future__ import annotations

import csv
import io
import os
import shutil
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from conftest import serve_admin_stack
from loramux.testing import write_peft_adapter

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip("Debian's chromium is not installed (make test installs it as root: apt-get install chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
openai = pytest.importorskip("openai")

ADMIN_KEY = "lmxa-console-browser-key-0123456789abcdefghijkl"
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("LORAMUX_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "console"
PAGES = ("tenants", "adapters", "prices", "usage", "engine")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_dir, tokenizer):
    yield from serve_admin_stack(tmp_path_factory.mktemp("console-browser"), tiny_dir, tokenizer, ADMIN_KEY)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, stack):
    context = browser.new_context(viewport={"width": 1280, "height": 800}, base_url=stack[0].url,
                                  accept_downloads=True)
    yield context.new_page()
    context.close()


def shoot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def sign_in(page) -> None:
    page.goto("/console/login")
    page.get_by_label("Admin key").fill(ADMIN_KEY)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("**/console/tenants")


def test_an_operator_runs_a_tenant_from_sign_in_to_revocation(page, stack, tmp_path):
    server, _, cfg, _ = stack
    expect = sync_api.expect
    page.goto("/console/tenants")
    page.wait_for_url("**/console/login")  # no session: sent to sign in
    shoot(page, "login")
    sign_in(page)
    shoot(page, "tenants")

    # A tenant and its key, shown once.
    page.get_by_label("Name").fill("initech")
    page.get_by_role("button", name="Create tenant").click()
    expect(page.get_by_role("heading", name="Tenant initech")).to_be_visible()
    page.get_by_role("button", name="Create key").click()
    raw_key = page.locator("#new-key").inner_text().strip()
    assert raw_key.startswith("lmx-")
    shoot(page, "tenant")
    page.reload()  # the form's answer was the only place the key appeared
    assert raw_key not in page.content() and raw_key[:12] in page.content()
    tenant = server.services.tenancy.tenant("initech")

    # An adapter, validated; a pickle, refused with the validator's message and nothing stored.
    adapter_dir = write_peft_adapter(tmp_path / "bot", cfg, 4, ["q_proj", "v_proj"], seed=5)
    page.goto("/console/adapters")
    page.get_by_label("Tenant").select_option(label="initech")
    page.get_by_label("Name").fill("helpdesk")
    page.get_by_label("adapter_config.json").set_input_files(str(adapter_dir / "adapter_config.json"))
    page.get_by_label("adapter_model.safetensors").set_input_files(str(adapter_dir / "adapter_model.safetensors"))
    page.get_by_role("button", name="Upload and validate").click()
    page.wait_for_url("**/console/adapters?notice=uploaded")
    expect(page.locator("tr[data-adapter='helpdesk']")).to_be_visible()
    assert page.locator("tr[data-adapter='helpdesk'] .residency-device").inner_text() == "absent"
    before = server.services.registry.list_all(tenant.id)
    evil = tmp_path / "evil.safetensors"
    evil.write_bytes(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94.")  # a pickle, not safetensors
    page.get_by_label("Name").fill("evil")
    page.get_by_label("adapter_config.json").set_input_files(str(adapter_dir / "adapter_config.json"))
    page.get_by_label("adapter_model.safetensors").set_input_files(str(evil))
    page.get_by_role("button", name="Upload and validate").click()
    status = page.locator("#upload-status")
    expect(status).to_contain_text("Refused (400)")
    message = status.inner_text()
    assert "safetensors" in message.lower(), message
    shoot(page, "adapters-refused")
    assert server.services.registry.list_all(tenant.id) == before

    # A price for the base model.
    page.goto("/console/prices")
    page.get_by_label("Input", exact=True).fill("1.5")
    page.get_by_label("Cached input").fill("0.5")
    page.get_by_label("Output").fill("3")
    page.get_by_role("button", name="Set price").click()
    page.wait_for_url("**/console/prices?notice=saved")
    expect(page.get_by_role("cell", name="1.5", exact=True)).to_be_visible()
    shoot(page, "prices")

    # The tenant calls the API with its key.
    adapter_id = server.services.registry.list_all(tenant.id)[0].adapter_id
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=raw_key, max_retries=0, timeout=60)
    for i in range(3):
        for model in ("base", adapter_id):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"hello {i}"}],
                                           max_tokens=6, temperature=0)

    # Spend shows in the charts; the adapter is now on the device, with its requests of the last hour.
    page.goto("/console/usage")
    expect(page.locator("#total-requests")).to_have_text("6")
    expect(page.locator("#spend-by-tenant")).to_be_visible()
    page.wait_for_function("() => document.getElementById('spend-by-tenant').getAttribute('width') > 0")
    shoot(page, "usage")
    page.goto("/console/adapters")
    row = page.locator("tr[data-adapter='helpdesk']")
    assert row.locator(".residency-device").inner_text() in ("resident", "loading")
    assert row.locator("td.num").first.inner_text() == "3"
    shoot(page, "adapters")

    # The CSV export reconciles with the API's summary.
    page.goto("/console/usage")
    with page.expect_download() as download:
        page.get_by_role("link", name="CSV").click()
    rows = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    api = httpx.get(server.url + "/admin/billing/summary", headers=admin, timeout=30).json()
    assert len(rows) == api["total"]["requests"] == 6 + 0  # the only traffic of this server so far
    assert sum(Decimal(r["cost"]) for r in rows) == Decimal(api["total"]["cost"]) > 0
    assert sum(int(r["completion_tokens"]) for r in rows) == api["total"]["completion_tokens"]

    # The engine page refreshes itself.
    page.goto("/console/engine")
    expect(page.locator("#updated")).not_to_have_text("–")
    expect(page.locator("#running")).to_have_text("0")
    shoot(page, "engine")

    # Revoking the key: the tenant's next request is refused.
    page.goto(f"/console/tenants/{tenant.id}")
    page.get_by_role("button", name=f"Revoke key {raw_key[:12]}").click()
    page.wait_for_url("**?notice=revoked")
    expect(page.get_by_text("revoked", exact=False).first).to_be_visible()
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="base", messages=[{"role": "user", "content": "again"}], max_tokens=4)

    # Two of the screenshots are docs/admin-and-billing.md's.
    for name in ("adapters", "usage"):
        shutil.copyfile(ARTIFACTS / f"{name}.png", ROOT / "docs" / f"console-{name}.png")


def test_pages_are_usable_with_the_keyboard_labelled_and_fit_a_narrow_window(browser, stack):
    context = browser.new_context(viewport={"width": 390, "height": 844}, base_url=stack[0].url)
    page = context.new_page()
    try:
        sign_in(page)
        for name in PAGES:
            page.goto(f"/console/{name}")
            unlabelled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea')]
                .filter(e => e.type !== 'hidden' && !(e.labels && e.labels.length) && !e.getAttribute('aria-label'))
                .map(e => e.name || e.id)""")
            assert unlabelled == [], (name, unlabelled)
            overflow = page.evaluate("() => document.documentElement.scrollWidth"
                                     " - document.documentElement.clientWidth")
            wide = page.evaluate("""() => [...document.querySelectorAll('body *')]
                .filter(e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
                .map(e => e.tagName + '#' + e.id + '.' + e.className).slice(0, 5)""")
            assert overflow <= 1, (name, overflow, wide)  # wide tables scroll inside their own box
            shoot(page, f"narrow-{name}")
        # The first Tab reaches the skip link, which moves focus to the content; the nav follows.
        page.goto("/console/adapters")
        page.keyboard.press("Tab")
        assert page.evaluate("() => document.activeElement.textContent.trim()") == "Skip to content"
        page.keyboard.press("Enter")
        assert page.evaluate("() => document.activeElement.id") == "main"
        page.goto("/console/adapters")
        page.keyboard.press("Tab")
        page.keyboard.press("Tab")
        assert page.evaluate("() => document.activeElement.textContent.trim()") == "Tenants"
        page.keyboard.press("Enter")
        page.wait_for_url("**/console/tenants")
    finally:
        context.close()


def test_empty_states_say_what_to_do_next(browser, tmp_path_factory, tiny_dir, tokenizer):
    stack = serve_admin_stack(tmp_path_factory.mktemp("console-empty"), tiny_dir, tokenizer, ADMIN_KEY)
    server = next(stack)[0]
    try:
        context = browser.new_context(viewport={"width": 1280, "height": 800}, base_url=server.url)
        page = context.new_page()
        sign_in(page)
        page.goto("/console/adapters")
        assert "No adapters yet. Upload a PEFT adapter above" in page.content()
        page.goto("/console/prices")
        assert "No price is in force" in page.content()
        page.goto("/console/usage")
        assert "No requests in this period" in page.content()
        context.close()
    finally:
        stack.close()


def test_an_operator_merges_adapters_and_sees_where_the_merge_came_from(page, stack, tmp_path):
    server, _, cfg, _ = stack
    expect = sync_api.expect
    server.services.tenancy.ensure_tenant("mergeco", tier="standard")
    tenant = server.services.tenancy.tenant("mergeco")
    parts = {}
    for name, seed in (("tone", 1), ("facts", 2)):
        directory = write_peft_adapter(tmp_path / name, cfg, 4, ["q_proj", "v_proj"], seed=seed)
        parts[name] = server.services.registry.register(tenant.id, name, {
            f: directory / f for f in ("adapter_config.json", "adapter_model.safetensors")})
    sign_in(page)
    page.goto("/console/adapters")
    page.get_by_label("Owner").select_option(label="mergeco")
    page.get_by_label("New adapter").fill("blend")
    page.get_by_label("Method", exact=True).select_option("ties")
    page.get_by_label("Components").fill("tone=0.7\nfacts@1=0.3")
    page.get_by_label("density", exact=True).fill("0.5")
    page.get_by_role("button", name="Merge and store").click()
    page.wait_for_url("**?notice=merged")
    expect(page.get_by_role("heading", name="Version 1 is a merge")).to_be_visible()
    section = page.locator("section.provenance")
    expect(section).to_contain_text("ties")
    expect(section).to_contain_text(parts["facts"].digest[:16])
    shoot(page, "adapter-merged")
    page.goto("/console/adapters")
    page.get_by_label("Owner").select_option(label="mergeco")
    page.get_by_label("New adapter").fill("bad")
    page.get_by_label("Method", exact=True).select_option("linear")
    page.get_by_label("Components").fill("tone\nmissing")
    page.get_by_role("button", name="Merge and store").click()
    expect(page.get_by_role("alert")).to_contain_text("components[1]: adapter 'missing' not found")
    assert "bad" not in {v.name for v in server.services.registry.list_all(tenant.id)}


def test_the_tenant_page_charts_the_periods_spend_against_the_budget(page, stack):
    """Last in this module: its ledger rows would change the spend the first test reconciles."""
    from sqlalchemy import insert

    from loramux.db.models import LedgerEntry, utcnow

    server = stack[0]
    expect = sync_api.expect
    services = server.services
    services.tenancy.ensure_tenant("chartco", tier="standard")
    tenant = services.tenancy.tenant("chartco")
    key = services.tenancy.create_key("chartco")[0]
    now = utcnow()
    with services.db.session() as session:
        session.execute(insert(LedgerEntry), [dict(
            request_id=f"chart-{i}", part=0, tenant_id=tenant.id, key_id=key.id, model="tiny", adapter_id=None,
            adapter_version=None, tier="standard", outcome="ok", fallback=False, prompt_tokens=10, cached_tokens=0,
            completion_tokens=5, queue_ms=None, ttft_ms=None, total_ms=1.0, price_id=None,
            input_per_mtok=Decimal(0), cached_input_per_mtok=Decimal(0), output_per_mtok=Decimal(0),
            cost=Decimal(cost), created_at=now, tags=tags)
            for i, (cost, tags) in enumerate((("1.25", ["chart-a"]), ("0.5", ["chart-a", "chart-b"])))])
    sign_in(page)
    page.goto(f"/console/tenants/{tenant.id}")
    page.get_by_label("Scope").select_option(label="the whole tenant")
    page.get_by_label("Limit (USD)").fill("4.000000000001")
    page.get_by_label("Period", exact=True).select_option("week")
    page.get_by_role("button", name="Set budget").click()
    page.wait_for_url("**?notice=budget-set")
    row = page.locator("tr[data-budget='tenant:']")
    expect(row).to_contain_text("4.000000000001")
    expect(row).to_contain_text("1.75")  # this week's spend, counted from the ledger when the budget was set
    page.wait_for_function("() => document.getElementById('budget-chart').getAttribute('width') > 0")
    drawn = """() => {
        const canvas = document.getElementById('budget-chart');
        const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        const bad = getComputedStyle(document.documentElement).getPropertyValue('--bad').trim();
        const [r, g, b] = [1, 3, 5].map(i => parseInt(bad.slice(i, i + 2), 16));
        let painted = 0, limit = 0;
        for (let i = 0; i < pixels.length; i += 4) {
          if (pixels[i + 3] > 0) { painted++; }
          if (pixels[i] === r && pixels[i + 1] === g && pixels[i + 2] === b && pixels[i + 3] === 255) { limit++; }
        }
        return {painted, limit, datasets: Chart.getChart(canvas).data.datasets.map(d => d.label)};
    }"""
    seen = page.evaluate(drawn)
    assert seen["datasets"] == ["daily spend (USD)", "cumulative spend (USD)", "limit (USD)"], seen
    assert seen["painted"] > 1000 and seen["limit"] > 20, seen  # bars, axes and the limit's dashed line
    assert page.get_by_role("img", name="Daily spend in USD").count() == 1
    shoot(page, "tenant-budget")
    shutil.copyfile(ARTIFACTS / "tenant-budget.png", ROOT / "docs" / "console-tenant-budget.png")  # the docs' picture
    page.set_viewport_size({"width": 390, "height": 844})  # a narrow window: only the table scrolls, in its box
    page.reload()
    page.wait_for_function("() => document.getElementById('budget-chart').getAttribute('width') > 0")
    wide = page.evaluate("""() => [...document.querySelectorAll('body *')]
        .filter(e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
        .map(e => e.tagName + '#' + e.id + '.' + e.className).slice(0, 5)""")
    assert page.evaluate("() => document.documentElement.scrollWidth - document.documentElement.clientWidth") <= 1, wide
    shoot(page, "narrow-tenant-budget")
    page.set_viewport_size({"width": 1280, "height": 800})

    # Removed: the chart is the last 30 days' spend, without a limit line.
    page.get_by_role("button", name="Remove the tenant budget").click()
    page.wait_for_url("**?notice=budget-removed")
    expect(page.locator("tr[data-budget='tenant:']")).to_have_count(0)
    page.wait_for_function("() => document.getElementById('budget-chart').getAttribute('width') > 0")
    seen = page.evaluate(drawn)
    assert seen["datasets"] == ["daily spend (USD)", "cumulative spend (USD)"] and seen["limit"] == 0, seen

    # The usage page stacks the last 30 days' spend by tag.
    page.goto("/console/usage")
    expect(page.locator("tr[data-tag='chart-a'] td.num").last).to_have_text("1.75")
    page.wait_for_function("() => document.getElementById('spend-by-tag').getAttribute('width') > 0")
    stacked = page.evaluate("""() => {
        const chart = Chart.getChart(document.getElementById('spend-by-tag'));
        return {tags: chart.data.datasets.map(d => d.label), stacked: chart.options.scales.y.stacked};
    }""")
    assert stacked == {"tags": ["chart-a", "chart-b"], "stacked": True}, stacked
    shoot(page, "usage-tags")
