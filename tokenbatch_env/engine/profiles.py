"""Engine profiles: a cost model plus the engine configuration it was measured for.

Profiles are package data (``tokenbatch_env/data/profiles/<name>.json``) carrying their provenance
("fitted", "derived", "synthetic"; "fitted (user)" for ``tokenbatch profiles fit --samples``), so every
report can say where its iteration times came from.
"""

from __future__ import annotations

import dataclasses
import json
import math
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Optional

from ..errors import ProfileError
from .cost_model import CostModel

#: A fitted profile whose mean absolute % error on any batch kind exceeds this is rejected.
MAX_MAPE_PCT = 10.0
PROVENANCES = ("fitted", "derived", "synthetic", "fitted (user)")
#: the fields a profile file must give (the others have documented defaults)
REQUIRED_FIELDS = ("name", "provenance", "cost", "block_size", "num_blocks", "max_num_batched_tokens",
                   "max_num_seqs", "max_model_len_limit")


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    provenance: str
    cost: CostModel
    block_size: int = 16
    num_blocks: int = 512              # total GPU blocks, including block 0 (reserved in vLLM mode)
    max_num_batched_tokens: int = 2048  # B
    max_num_seqs: int = 256
    max_model_len_limit: int = 4096    # the model's own context limit
    watermark_blocks: int = 0          # vLLM's admission watermark, in blocks
    async_scheduling: bool = False
    kv_bytes_per_token: int = 524288
    pcie_gb_per_s: float = 25.0        # for swap preemption (beyond vLLM)
    mape_pct: Optional[dict] = None    # {"prefill": .., "decode": .., "mixed": ..} for fitted profiles
    description: str = ""
    source: dict = dataclasses.field(default_factory=dict)
    #: the largest token budget a lever may choose (docs/design.md section 3, "A profile for your
    #: deployment"); None: the profile's max_num_batched_tokens. Last, and left out of ``to_dict``
    #: when None, so the dicts (and evidence ids) of profiles without it are unchanged.
    b_max: Optional[int] = None

    def __post_init__(self):
        if self.provenance not in PROVENANCES:
            raise ProfileError(f"profile {self.name!r}: provenance must be one of {PROVENANCES}, "
                               f"got {self.provenance!r}")
        for f in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs",
                  "max_model_len_limit"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ProfileError(f"profile {self.name!r}: {f} must be a positive integer, got {v!r}")
        if self.num_blocks < 2:
            raise ProfileError(f"profile {self.name!r}: num_blocks must be >= 2 (block 0 is reserved)")
        if not isinstance(self.watermark_blocks, int) or not 0 <= self.watermark_blocks < self.usable_blocks:
            raise ProfileError(f"profile {self.name!r}: watermark_blocks must be in [0, usable blocks)")
        if self.b_max is not None and (not isinstance(self.b_max, int) or isinstance(self.b_max, bool)
                                       or self.b_max < self.max_num_batched_tokens):
            raise ProfileError(f"profile {self.name!r}: b_max must be an integer >= max_num_batched_tokens "
                               f"({self.max_num_batched_tokens}), got {self.b_max!r}")
        if self.mape_pct is not None:
            if (not isinstance(self.mape_pct, dict) or not self.mape_pct
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                               for v in self.mape_pct.values())):
                raise ProfileError(f"profile {self.name!r}: mape_pct must be a non-empty object of finite "
                                   f"numbers (fit errors in % by batch kind), got {self.mape_pct!r}")
            worst = max(self.mape_pct.values())
            if worst > MAX_MAPE_PCT:
                raise ProfileError(f"profile {self.name!r}: fit error {worst:.1f}% > {MAX_MAPE_PCT}% on "
                                   f"{max(self.mape_pct, key=self.mape_pct.get)} batches; rejected")

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def max_model_len(self) -> int:
        return min(self.max_model_len_limit, self.usable_blocks * self.block_size)

    @property
    def budget_max(self) -> int:
        """The largest token budget a lever may choose: ``b_max``, else ``max_num_batched_tokens``."""
        return self.max_num_batched_tokens if self.b_max is None else self.b_max

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["cost"] = self.cost.to_dict()
        b_max = d.pop("b_max")
        if b_max is None:
            return d
        out = {}
        for k, v in d.items():   # placed beside the budget it bounds
            out[k] = v
            if k == "max_num_batched_tokens":
                out["b_max"] = b_max
        return out

    @classmethod
    def from_dict(cls, d: dict, *, where: str = "profile") -> "Profile":
        if not isinstance(d, dict):
            raise ProfileError(f"{where}: expected a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ProfileError(f"{where}: unknown field(s) {unknown}; valid: {sorted(known)}")
        # a file states the engine's limits: the dataclass's defaults are for code, and a file
        # without its pool size silently ran 512 blocks
        missing = sorted(set(REQUIRED_FIELDS) - set(d))
        if missing:
            raise ProfileError(f"{where}: missing field(s) {missing}")
        kw = dict(d)
        try:
            kw["cost"] = CostModel(**kw["cost"])
        except (TypeError, ProfileError) as e:
            raise ProfileError(f"{where}: bad cost block: {e}") from None
        try:
            return cls(**kw)
        except ProfileError as e:   # (its checks name the profile; a file's reader needs the file)
            if str(e).startswith(where):
                raise
            raise ProfileError(f"{where}: {e}") from None


def _data_dir():
    return resources.files("tokenbatch_env") / "data" / "profiles"


def list_profiles() -> list[str]:
    return sorted(p.name[:-5] for p in _data_dir().iterdir() if p.name.endswith(".json"))


def is_profile_file(name_or_path: str) -> bool:
    """``load_profile``'s rule: a path to a JSON file, not a shipped profile's name."""
    return name_or_path.endswith(".json") or "/" in name_or_path


@lru_cache(maxsize=None)
def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a JSON file by path."""
    if is_profile_file(name_or_path):
        path = Path(name_or_path)
        if not path.exists():
            raise ProfileError(f"profile file {name_or_path!r} not found")
        text, where = path.read_text(), str(path)
    else:
        res = _data_dir() / f"{name_or_path}.json"
        if not res.is_file():
            raise ProfileError(f"unknown profile {name_or_path!r}; valid: {', '.join(list_profiles())}")
        text, where = res.read_text(), f"profile {name_or_path!r}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{where}: invalid JSON: {e}") from None
    return Profile.from_dict(data, where=where)


#: The terms and factors of the sensitivity row: the attention terms are the ones a long-context
#: profile extrapolates furthest past its fitting data (docs/design.md section 3).
SENSITIVITY_TERMS = ("c_attn", "c_kv")
SENSITIVITY_FACTORS = (0.5, 2.0)


def sensitivity_profiles(profile: Profile) -> list[tuple[str, Profile]]:
    """``[(label, profile)]``: ``profile`` with one of ``SENSITIVITY_TERMS`` scaled by one of
    ``SENSITIVITY_FACTORS`` (label "c_attn x0.5", name "<profile> c_attn x0.5"), 4 in all.

    A variant is no longer what was fitted or derived: provenance "derived", no fit error, and its
    ``source`` names the base profile and the change. Factors 0.5 and 2 are exact in binary, so
    the scaled coefficients are exact too."""
    out = []
    for term in SENSITIVITY_TERMS:
        for factor in SENSITIVITY_FACTORS:
            label = f"{term} x{factor:g}"
            value = getattr(profile.cost, term) * factor
            out.append((label, dataclasses.replace(
                profile, name=f"{profile.name} {label}", provenance="derived", mape_pct=None,
                cost=dataclasses.replace(profile.cost, **{term: value}),
                description=f"{profile.name} with {term} x{factor:g} (sensitivity variant).",
                source={"base_profile": profile.name, "scale": {term: factor}})))
    return out
