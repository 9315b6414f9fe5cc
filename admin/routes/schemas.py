"""The admin API's response models: the JSON each /admin route returns, as its OpenAPI schema documents it."""
from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PlainSerializer

from loramux.tenancy.tenants import TierInfo

# Times are `datetime.isoformat()` strings and prices plain decimal strings, never floats.
IsoDatetime = Annotated[datetime, PlainSerializer(datetime.isoformat, return_type=str)]
Money = Annotated[Decimal, PlainSerializer(str, return_type=str)]
Cost = Annotated[Decimal, PlainSerializer(lambda d: format(d, "f"), return_type=str)]  # 12 decimals, never 0E-12


class Out(BaseModel):
    """A response read from the attributes of a data-access DTO (routes may return the DTO itself)."""

    model_config = ConfigDict(from_attributes=True)


# -- tenants and their keys -------------------------------------------------------------------------
class Tenant(Out):
    id: str
    name: str
    tier: str
    status: str
    fallback: str = Field(description="'none', 'base' or an adapter reference")
    created_at: IsoDatetime


class TenantList(Out):
    tenants: list[Tenant]


class Key(Out):
    """A key as listed: never the raw key."""

    id: str
    prefix: str
    created_at: IsoDatetime
    revoked_at: IsoDatetime | None


class KeyList(Out):
    keys: list[Key]


class NewKey(Out):
    """A key just made: `key` is the raw key, shown this once."""

    id: str
    key: str
    prefix: str


class RotatedKey(NewKey):
    revoked: str = Field(description="id of the key this one replaces, revoked now")


# -- adapters ---------------------------------------------------------------------------------------
class ModuleCoverage(Out):
    layers: list[int] = Field(description="the decoder layers whose module the adapter changes")
    rank_min: int
    rank_max: int
    scale_min: float
    scale_max: float


class DeviceBytes(Out):
    lora: int = Field(description="low-rank A/B weights as the device pool holds them (one slot)")
    dora: int = Field(description="DoRA magnitude vectors")
    embedding: int = Field(description="LoRA on the token embedding")
    heads: int = Field(description="fully trained lm_head / embed_tokens copies (modules_to_save)")
    experts: int = Field(default=0, description="LoRA on the routed experts of a mixture-of-experts base: "
                                                "experts x rank x (in + out) per expert projection and sparse layer")
    total: int


class ExpertCoverage(Out):
    rank: int = Field(description="the rank of every expert's pair on this projection")
    layers: list[int] = Field(description="the sparse layers whose experts the adapter changes")


class AdapterSummary(Out):
    """What the adapter changes in the base model, as validation found it at upload."""

    rank: int
    lora_alpha: float
    use_rslora: bool
    scale: float = Field(description="lora_alpha / r (or / sqrt(r) with rsLoRA): modules without a pattern")
    layout: Literal["plain", "per-module"] = Field(
        description="per-module: rank_pattern / alpha_pattern or a layer subset; plain: one r and alpha everywhere")
    modules: dict[str, ModuleCoverage] = Field(description="each projection the adapter changes (q_proj, ...)")
    dora: bool
    embedding: dict | None = Field(description="LoRA on embed_tokens ({rank}), or null")
    heads: list[str] = Field(description="modules replaced by trained copies (lm_head, embed_tokens)")
    experts: dict[str, ExpertCoverage] = Field(
        default_factory=dict, description="LoRA on the routed experts (gate_up, down) of a mixture-of-experts base")
    device_bytes: DeviceBytes = Field(description="bytes the adapter takes in device memory, at the engine's dtype")


class MergedComponent(Out):
    adapter_id: str
    version: int
    digest: str = Field(description="the component version's content digest")
    weight: float


class Provenance(Out):
    """How a merged version was made (POST /admin/adapters/merge)."""

    method: str = Field(description="cat, linear, ties, dare_linear, dare_ties or svd (PEFT's combination_type)")
    parameters: dict = Field(description="the method's parameters as run (density, majority_sign_method, seed, "
                                         "svd_rank, svd_clamp); DARE's seed is recorded even when chosen by the server")
    components: list[MergedComponent]
    peft_version: str | None = Field(default=None, description="the PEFT release whose add_weighted_adapter merged")


class UploadedAdapter(Out):
    id: str = Field(validation_alias=AliasChoices("id", "adapter_id"))
    name: str
    version: int
    digest: str
    tenant_id: str
    size_bytes: int
    summary: AdapterSummary | None = Field(
        default=None, description="what the adapter changes (modules and ranks, DoRA, embedding LoRA, heads, device "
                                  "bytes); null for versions uploaded before it was recorded")
    provenance: Provenance | None = Field(
        default=None, description="for a version made by a merge: method, parameters and components; null for an "
                                  "upload")


class AdapterVersion(UploadedAdapter):
    visibility: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: list[str]
    base_model: str = Field(description="the base model this server served when the version was uploaded")
    claimed_base_model: str | None = Field(
        default=None, description="base_model_name_or_path from the adapter's config (a hub id or the local path "
                                  "it was trained from); null when the config names none")
    base_family: str | None = Field(
        default=None, description="model_type of the base model the weights were validated against (llama, "
                                  "qwen3, gemma3_text, phi3, ...); null for versions uploaded before it was recorded")
    created_at: IsoDatetime


class AdapterList(Out):
    adapters: list[AdapterVersion] = Field(description="the latest version of each live adapter")


class AdapterResidency(Out):
    """Where the adapter's latest version is right now, tier by tier (a version may be in several)."""

    version: int = Field(description="the version this describes: the latest ready one")
    device: Literal["resident", "loading", "absent"] = Field(
        description="on this server's device (resident), being copied there (loading), or not there (absent)")
    ram: bool = Field(description="in this server's host RAM cache")
    disk: bool = Field(description="in this server's local disk cache")
    store: bool = Field(description="in the object store: always true for a ready version")


class RecentRequests(Out):
    """Requests this server started with the adapter (any version), counted per second of a monotonic clock."""

    last_60s: int = Field(description="requests in the last 60 seconds")
    last_300s: int = Field(description="requests in the last 300 seconds")
    per_minute: float = Field(description="the average rate over the last 300 seconds, in requests per minute")


class AdapterDetail(Out):
    id: str
    tenant_id: str
    versions: list[AdapterVersion] = Field(description="every ready version, oldest first")
    pinned: bool
    residency: AdapterResidency | None = Field(
        description="where the latest version is now on this server (null when no version is ready)")
    recent_requests: RecentRequests = Field(description="how much this adapter is used on this server now")


class DeletedAdapter(Out):
    id: str
    deleted_versions: list[int]


class WarmedAdapter(Out):
    id: str
    version: int
    loaded_from: str = Field(description="the tier it came from: store, disk or ram")
    load_ms: float


class PinState(Out):
    id: str
    pinned: bool


# -- tiers and prices -------------------------------------------------------------------------------
Tier = TierInfo  # the tenancy DTO is a dataclass: pydantic documents and serialises it as it is


class TierList(Out):
    tiers: list[Tier]


class Price(Out):
    id: int
    base_model: str
    adapter_id: str | None
    tier: str | None
    input_per_mtok: Money
    cached_input_per_mtok: Money
    output_per_mtok: Money
    effective_from: IsoDatetime


class PriceList(Out):
    prices: list[Price]


# -- admin keys -------------------------------------------------------------------------------------
class AdminKey(Key):
    name: str


class AdminKeyList(Out):
    keys: list[AdminKey]


class RevokedAdminKey(Out):
    id: str
    revoked_at: IsoDatetime


# -- billing ----------------------------------------------------------------------------------------
class Counters(Out):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: Cost = Field(description="USD, exact, 12 decimals")


class TenantCounters(Counters):
    tenant_id: str


class AdapterCounters(TenantCounters):
    adapter_id: str | None = Field(description="null: the base model")


class Period(Out):
    start: str | None = Field(description="ISO 8601 UTC, inclusive; null: open")
    end: str | None = Field(description="ISO 8601 UTC, exclusive; null: open")


class BillingSummary(Out):
    """Ledger totals over a period (see `loramux.billing.reports.summary`)."""

    period: Period
    tenant_id: str | None
    currency: str
    total: Counters
    tenants: list[TenantCounters] = Field(description="by tenant id")
    adapters: list[AdapterCounters] = Field(description="by tenant, then adapter id, the base model first")
    outcomes: dict[str, int] = Field(description="requests by outcome")


# -- Medusa heads -----------------------------------------------------------------------------------
class MedusaHeads(Out):
    """One upload of Medusa speculative-decoding heads."""

    id: str
    kind: str = Field(description="the kind of speculator: medusa")
    target: str = Field(description="'base' (the base model) or the adapter version, <adapter id>@<version>")
    adapter_id: str | None = Field(description="the adapter whose version the heads serve; null: the base model")
    adapter_name: str | None
    tenant_id: str | None = Field(description="the adapter's owner; null for base-model heads")
    version: int | None = Field(description="the adapter version; null for base-model heads")
    base_model: str = Field(description="the base model this server served when the heads were uploaded")
    digest: str
    size_bytes: int
    num_heads: int
    hidden_size: int
    config: dict = Field(description="medusa_config.json as uploaded")
    created_at: IsoDatetime
    active: bool = Field(description="whether requests use these heads (false: deleted or replaced)")
    deleted_at: IsoDatetime | None = None
    replaced_by: str | None = Field(default=None, description="id of the upload that replaced these heads")


class MedusaHeadsList(Out):
    heads: list[MedusaHeads] = Field(description="newest first")
