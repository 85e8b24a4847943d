"""Parameter files: the ``--params`` JSON that ``tokenbatch tune`` writes (``best_params.json``) and
the evaluator, the env (``base_params``), the agents and the vLLM plug-in read (docs/design.md
sections 6 and 7).

    {"index": {IndexParams fields}, "shed_margin": x,        # the index and its +shed margin
     "<policy>": {"shed_margin": y},                          # another policy's +shed margin
     "weights": {"w": {feature: weight}, "shed_margin": z},   # the weights policy
     "index-scheduled": IndexSchedule.to_dict(),              # the index-scheduled comparator
     "levers": {"<row label>": {flag: value}},                # tuned vLLM flags per row (section 11)
     "tpot-guard": {"index": {...}, "shed_margin": x, ...},   # the +tpot-guard rows' own policy parameters
     "meta": {...}, "tuned": {...}, ...}                      # informational (PARAMS_INFO_KEYS)

``meta`` carries the units the parameters were tuned in (docs/design.md section 10): ``t_ref_mode``
(``fixed`` or ``trace``), ``t_ref_ms``, and the deployment: ``profile`` (name or path),
``profile_sha256``, ``predictor``, and what was fitted to the tuning data (``fitted``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Optional

from .errors import ConfigError, PolicyError

__all__ = ["CLUSTER_KEY", "GUARD_KEY", "LEVERS_KEY", "PARAMS_INFO_KEYS", "ROBUST_FILE", "ROBUST_FORMAT", "RoutedRow",
           "SCHEDULE_KEY", "T_REF_MODES", "check_row_levers", "deployment_of", "deployment_warnings", "levers_for",
           "load_deployment", "load_guard_params", "load_levers", "load_params_file", "load_robust_defaults",
           "load_routed", "load_schedule", "load_weights", "profile_sha256", "routed_row_kind"]

#: how a parameters file's T_ref is set (docs/design.md section 10, "Units travel with parameters"):
#: "fixed" = the T_ref of the deployment it was tuned on, in the file; "trace" = the median T1 of the
#: evaluated workload's train part
T_REF_MODES = ("fixed", "trace")

#: informational keys tolerated in a --params file
PARAMS_INFO_KEYS = ("meta", "provenance", "source", "tuned", "comment")
#: the params-file key of the ``index-scheduled`` comparator (``policies.IndexSchedule.to_dict``)
SCHEDULE_KEY = "index-scheduled"
#: the params-file key of the rows' tuned levers (docs/design.md section 11): row label -> {flag: value}
LEVERS_KEY = "levers"
#: the params-file key of the ``<row>+tpot-guard`` rows' own policy parameters, tuned with u and B_min
#: (docs/design.md section 11): the index's and the shed margins, in the top level's shape
GUARD_KEY = "tpot-guard"
#: the params-file key of a cluster's rows tuned router by router (``tokenbatch tune --replicas R``,
#: docs/design.md section 12): {"replicas": R, "routers": [...], "rows": {"<router> x <row>": {"index":
#: {...}, "shed_margin": x, "levers": {flag: value}, "router": {param: value}}}}
CLUSTER_KEY = "cluster"


@dataclasses.dataclass(frozen=True)
class RoutedRow:
    """One cluster row's own tuned values (docs/design.md section 12: a row is router x policy x
    levers; ``tokenbatch tune --replicas R`` tunes each): the index's parameters (None: the
    benchmark's), the shed margin (None: the benchmark's), vLLM's levers and the router's parameters
    (``(("alpha", a), ("beta", b))``). ``evaluate.BenchConfig.routed`` maps ``"<router> x <row>"`` to it."""

    index_params: object = None
    shed_margin: Optional[float] = None
    levers: tuple = ()
    router_params: tuple = ()


def load_params_file(path: str, what: str = "--params") -> tuple:
    """A ``--params`` file: ``{"index": {IndexParams fields}, "shed_margin": x, "<policy>":
    {"shed_margin": y}, ...}`` -> (IndexParams, ((policy, margin), ...)). ``shed_margin`` at top
    level is the index's; other policies' margins default to 0.0. ``what``: the option or field
    that gave the path, named in errors."""
    from .policies import BASELINES

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: {path!r} is a directory, not a parameters JSON" if p.is_dir()
                          else f"{what}: file {path!r} not found")
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path}: invalid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{what} {path}: expected a JSON object")
    valid = ["index", "shed_margin", *[b for b in BASELINES if b != "index"], SCHEDULE_KEY, LEVERS_KEY, GUARD_KEY,
             CLUSTER_KEY, *PARAMS_INFO_KEYS]
    unknown = sorted(k for k in d if k not in valid and not k.startswith("_"))
    if d.get("format") == ROBUST_FORMAT:
        raise ConfigError(f"{what} {path}: a robust-defaults file, not a parameters file: give it as --defaults FILE")
    if unknown:
        raise ConfigError(f"{what} {path}: unknown key(s) {unknown}; valid: {', '.join(valid)}")
    params, margins = _policy_parameters(d, f"{what} {path}")
    if GUARD_KEY in d:
        g = d[GUARD_KEY]
        gvalid = ["index", "shed_margin", *[b for b in BASELINES if b not in ("index", "weights")]]
        if not isinstance(g, dict) or set(g) - set(gvalid):
            bad = f" (unknown: {', '.join(sorted(set(g) - set(gvalid)))})" if isinstance(g, dict) else ""
            raise ConfigError(f"{what} {path}: {GUARD_KEY!r} must be an object with keys among {', '.join(gvalid)}"
                              + bad)
        _policy_parameters(g, f"{what} {path}: {GUARD_KEY}")
    if LEVERS_KEY in d:
        try:
            check_row_levers(d[LEVERS_KEY] if isinstance(d[LEVERS_KEY], dict) else ())
        except ConfigError as e:
            raise ConfigError(f"{what} {path}: {e}") from None
        if not isinstance(d[LEVERS_KEY], dict):
            raise ConfigError(f"{what} {path}: {LEVERS_KEY!r} must be an object: row label -> {{flag: value}}")
    return params, margins


def _policy_parameters(d: dict, where: str) -> tuple:
    """The index's parameters and the shed margins of a parameters document (or of its ``GUARD_KEY``
    part) -> (IndexParams, ((policy, margin), ...)); an error names ``where``."""
    from .policies import BASELINES, IndexParams, check_shed_margin
    idx = d.get("index", {})
    if not isinstance(idx, dict):
        raise ConfigError(f"{where}: 'index' must be an object of IndexParams fields")
    try:
        params = IndexParams.from_dict(idx)
    except (TypeError, ValueError) as e:
        raise PolicyError(f"{where}: {e}") from None
    margins = {}

    def margin(v, who):
        if v is None or v == "inf":   # (null, like inf: no shedding)
            v = math.inf
        try:
            check_shed_margin(v)
        except PolicyError as e:
            raise PolicyError(f"{where}: {who}: {e}") from None
        return float(v)

    if "shed_margin" in d:
        margins["index"] = margin(d["shed_margin"], "shed_margin")
    for b in BASELINES:
        if b == "index" or b not in d:
            continue
        v = d[b]
        allowed = {"shed_margin", "w"} if b == "weights" else {"shed_margin"}
        if not isinstance(v, dict) or set(v) - allowed:
            raise ConfigError(f"{where}: {b!r} must be {{\"shed_margin\": x}}"
                              + (" with optional \"w\": {feature: weight}" if b == "weights" else ""))
        if "shed_margin" in v:
            margins[b] = margin(v["shed_margin"], f"{b}.shed_margin")
    return params, tuple(sorted(margins.items()))


def load_guard_params(path: str, what: str = "--params"):
    """The ``<row>+tpot-guard`` rows' own parameters in a ``--params`` file (its ``GUARD_KEY`` part,
    tuned with u and B_min): (IndexParams or None, ((policy, margin), ...)), or None when it has no
    such part. What the part leaves out (the index's parameters, a policy's margin) is the row's
    without the rule: the index None, the margin absent."""
    load_params_file(path, what)
    d = json.loads(Path(path).read_text())
    if GUARD_KEY not in d:
        return None
    params, margins = _policy_parameters(d[GUARD_KEY], f"{what} {path}: {GUARD_KEY}")
    return (params if "index" in d[GUARD_KEY] else None), margins


def load_levers(path: str, what: str = "--params") -> tuple:
    """The rows' tuned levers in a ``--params`` file (``BenchConfig.levers``), () when it has none."""
    load_params_file(path, what)
    return check_row_levers(json.loads(Path(path).read_text()).get(LEVERS_KEY, {}))


def routed_row_kind(plain: str) -> Optional[str]:
    """What a cluster tuning tunes of the row ``plain`` (a label without its router): ``"index"``
    (index+shed), ``"margin"`` (a baseline's +shed row), ``"flags"`` (FCFS or priority with tuned
    vLLM flags), each optionally with ``+tpot-guard`` (not a flags row); None for another label."""
    from .engine.levers import FLAGS_SUFFIX, GUARD_SUFFIX
    from .policies import policy_names
    base = plain.removesuffix(GUARD_SUFFIX)
    if base == "index+shed":
        return "index"
    if base in {f"{b}+shed" for b in policy_names(tuned="margin")}:
        return "margin"
    if plain in (f"fcfs{FLAGS_SUFFIX}", f"priority{FLAGS_SUFFIX}"):
        return "flags"
    return None


#: the keys of a cluster part's row, by ``routed_row_kind``
_ROUTED_KEYS = {"index": ("index", "shed_margin", "levers", "router"), "margin": ("shed_margin", "levers", "router"),
                "flags": ("levers", "router")}


def load_routed(path: str, what: str = "--params") -> Optional[dict]:
    """A ``--params`` file's cluster part (``CLUSTER_KEY``) -> {"replicas": R, "routers": (...),
    "metrics_staleness_ms": S, "routed": (("<router> x <row>", RoutedRow), ...)}
    (``BenchConfig.routed``), or None when it has none. Each row is a tuned row behind a known router
    with only the keys its kind has (``routed_row_kind``). Errors name the file and the row."""
    from .engine.cluster import ROUTER_NAMES, ROUTERS, Router
    from .policies import IndexParams, check_shed_margin
    load_params_file(path, what)
    doc = json.loads(Path(path).read_text())
    if CLUSTER_KEY not in doc:
        return None
    d = doc[CLUSTER_KEY]
    where = f"{what} {path}: {CLUSTER_KEY}"
    if not isinstance(d, dict) or not isinstance(d.get("rows"), dict) or not d["rows"]:
        raise ConfigError(f"{where}: expected {{\"replicas\": R, \"routers\": [...], \"rows\": {{...}}}} "
                          f"with at least one row, got {json.dumps(d)[:80]}")
    R = d.get("replicas")
    if isinstance(R, bool) or not isinstance(R, int) or R < 2:
        raise ConfigError(f"{where}: replicas must be an integer >= 2, got {R!r}")
    routers = d.get("routers")
    if not isinstance(routers, list) or not routers or any(r not in ROUTER_NAMES for r in routers) \
            or len(set(routers)) != len(routers):
        raise ConfigError(f"{where}: routers must be a non-empty list of distinct router names "
                          f"({', '.join(ROUTER_NAMES)}), got {routers!r}")
    st = d.get("metrics_staleness_ms", 0.0)
    if isinstance(st, bool) or not isinstance(st, (int, float)) or not math.isfinite(st) or st < 0:
        raise ConfigError(f"{where}: metrics_staleness_ms must be a number of ms >= 0, got {st!r}")
    routed = []
    for label, v in sorted(d["rows"].items()):
        router, sep, plain = label.partition(" x ")
        if not sep or router not in ROUTERS:
            raise ConfigError(f"{where}: row {label!r} is not '<router> x <row>' with a known router")
        if router not in routers:   # (the routers list is what the bench's warnings and the top level read)
            raise ConfigError(f"{where}: row {label!r} is behind {router}, not one of routers {routers}")
        kind = routed_row_kind(plain)
        if kind is None:
            raise ConfigError(f"{where}: row {label!r}: {plain!r} is not a tuned row (index+shed, <baseline>+shed, "
                              "fcfs or priority (tuned vLLM flags), the +shed rows also with +tpot-guard)")
        keys = _ROUTED_KEYS[kind]
        extra = sorted(set(v) - set(keys)) if isinstance(v, dict) else None
        if extra is None or extra:
            raise ConfigError(f"{where}: row {label!r} must be an object with keys among {', '.join(keys)}"
                              + (f" (unknown: {', '.join(extra)})" if extra else ""))
        try:
            if "index" in v and not isinstance(v["index"], dict):
                raise ConfigError("index: must be an object of IndexParams fields")
            ip = IndexParams.from_dict(v["index"]) if "index" in v else None
            m = v.get("shed_margin")
            m = None if m is None else check_shed_margin(math.inf if m == "inf" else m)
            rp = v.get("router", {})
            if not isinstance(rp, dict) or set(rp) - set(ROUTERS[router].params):
                raise ConfigError(f"router: {rp!r}; {router}'s parameters: "
                                  f"{', '.join(ROUTERS[router].params) or 'none'}")
            for k, x in rp.items():
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    raise ConfigError(f"router.{k}: must be a number, got {x!r}")
            Router(router, **rp)
            lv = check_row_levers({plain: v.get("levers", {})}) if v.get("levers") else ()
        except (ConfigError, PolicyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: row {label!r}: {e}") from None
        routed.append((label, RoutedRow(ip, m, lv[0][1] if lv else (),
                                        tuple(sorted((k, float(x)) for k, x in rp.items())))))
    return {"replicas": R, "routers": tuple(routers), "metrics_staleness_ms": float(st), "routed": tuple(routed)}


def load_schedule(path: str, what: str = "--params"):
    """The ``index-scheduled`` schedule in a ``--params`` file, or None when it has none."""
    from .policies import IndexSchedule
    load_params_file(path, what)
    d = json.loads(Path(path).read_text())
    if SCHEDULE_KEY not in d:
        return None
    try:
        return IndexSchedule.from_dict(d[SCHEDULE_KEY])
    except (PolicyError, TypeError, ValueError) as e:
        raise PolicyError(f"{what} {path}: {SCHEDULE_KEY}: {e}") from None


def load_weights(path: str, what: str = "--params"):
    """The ``weights`` policy's tuned weights in a ``--params`` file (``{"weights": {"w": ...}}``),
    or None when the file has none (validated by ``load_params_file`` first)."""
    from .policies import LinearWeights
    load_params_file(path, what)
    v = json.loads(Path(path).read_text()).get("weights", {})
    if "w" not in v:
        return None
    try:
        return LinearWeights.from_dict(v["w"])
    except PolicyError as e:
        raise PolicyError(f"{what} {path}: weights.w: {e}") from None


def profile_sha256(profile) -> str:
    """SHA-256 of a profile's canonical JSON: two profiles that price work alike have the same."""
    import hashlib

    from .util import canonical_json
    return hashlib.sha256(canonical_json(profile.to_dict()).encode()).hexdigest()


def deployment_of(profile, predictor, t_ref_ms: float, t_ref_mode: str = "fixed",
                  fitted: Optional[dict] = None) -> dict:
    """The ``meta`` block of a parameters file tuned on ``profile`` (resolved) with ``predictor`` (a
    PredictorSpec) at ``t_ref_ms``; ``fitted``: what was fitted to the tuning data (recorded)."""
    d = {"t_ref_mode": t_ref_mode, "t_ref_ms": float(t_ref_ms), "profile": profile.name,
         "profile_sha256": profile_sha256(profile), "predictor": predictor.to_dict()}
    if fitted:
        d["fitted"] = fitted
    return d


def load_deployment(path: str, what: str = "--params"):
    """The deployment a ``--params`` file was tuned on (its ``meta``, checked), or None without one.
    A file whose ``meta`` has a ``t_ref_ms`` but no ``t_ref_mode`` (written before the mode existed)
    is ``fixed``."""
    d = json.loads(Path(path).read_text())
    meta = d.get("meta")
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise ConfigError(f"{what} {path}: 'meta' must be an object")
    mode = meta.get("t_ref_mode", "fixed" if "t_ref_ms" in meta else None)
    if mode is None:
        return None
    if mode not in T_REF_MODES:
        raise ConfigError(f"{what} {path}: meta.t_ref_mode: one of {', '.join(T_REF_MODES)}, got {mode!r}")
    t = meta.get("t_ref_ms")
    if mode == "fixed" and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                            or t <= 0):
        raise ConfigError(f"{what} {path}: meta.t_ref_ms: a positive number (t_ref_mode fixed), got {t!r}")
    return {**meta, "t_ref_mode": mode}


def deployment_warnings(dep, profile, predictor) -> list:
    """One line per way the evaluated deployment (``profile`` resolved, ``predictor`` a PredictorSpec)
    differs from the one the parameters were tuned on (``dep``, ``load_deployment``'s)."""
    if not dep:
        return []
    out = []
    name = dep.get("profile")
    if name is not None and name != profile.name:
        out.append(f"the parameters were tuned on profile {name}; evaluated on {profile.name}")
    elif name is not None and dep.get("profile_sha256", profile_sha256(profile)) != profile_sha256(profile):
        out.append(f"the parameters were tuned on {name} with other engine settings (profile digest differs)")
    pred = dep.get("predictor")
    if pred is not None and pred != predictor.to_dict():
        out.append(f"the parameters were tuned with predictor {pred}; evaluated with {predictor.to_dict()}")
    return out


def check_row_levers(levers) -> tuple:
    """Rows' tuned levers (docs/design.md section 11; a dict or its items: row label -> {flag: value})
    as sorted, validated items. A levered row is a tuned row: ``<policy>``, ``<policy>+shed`` or
    ``fcfs``/``priority`` with the ``FLAGS_SUFFIX``."""
    from .engine.levers import FLAGS_SUFFIX, GUARD_SUFFIX, check_levers
    from .policies import BASELINES
    items = dict(levers).items() if not isinstance(levers, dict) else levers.items()
    out = []
    for label, lv in sorted(items):
        guard = label.endswith(GUARD_SUFFIX)
        plain = label.removesuffix(GUARD_SUFFIX)
        base = plain[:-len(FLAGS_SUFFIX)] if plain.endswith(FLAGS_SUFFIX) else plain.removesuffix("+shed")
        if base not in BASELINES or (plain.endswith(FLAGS_SUFFIX) and (base not in ("fcfs", "priority") or guard)) \
                or label in ("fcfs", "priority"):   # (vLLM's rows at the profile's flags: the reference rows)
            raise ConfigError(f"levers: {label!r} is not a row with levers: <policy> (not fcfs or priority), "
                              f"<policy>+shed, either with {GUARD_SUFFIX}, fcfs{FLAGS_SUFFIX} or "
                              f"priority{FLAGS_SUFFIX}")
        if not isinstance(lv, (dict, tuple)):
            raise ConfigError(f"levers[{label!r}]: expected an object {{flag: value}}, got {lv!r}")
        lv = check_levers(dict(lv), f"levers[{label!r}]", guard=guard)
        if lv:
            out.append((label, lv))
    return tuple(out)


# ------------------------------------------------------------------------------------ robust defaults
#: the shipped robust defaults (docs/design.md section 10; ``python tuning/robust_defaults.py --install``)
ROBUST_FILE = Path(__file__).parent / "data" / "params" / "robust-defaults.json"
ROBUST_FORMAT = "tokenbatch-robust-defaults"


def load_robust_defaults(path=None, what: str = "robust defaults") -> dict:
    """The robust-defaults file (default: the shipped one), checked: the index's parameters, its
    shed margin, the tpot-guard rule's u and B_min and vLLM's flags as fractions of a profile's.
    ``what``: the option or field that gave the path, named in errors."""
    from .engine.levers import GUARD_LEVERS, check_levers
    p = Path(path) if path is not None else ROBUST_FILE
    where = f"{what} {p}"
    if not p.is_file():
        raise ConfigError(f"{what}: file {str(p)!r} not found" + (
            " (python tuning/robust_defaults.py --install makes the shipped one)" if path is None else ""))
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: invalid JSON: {e}") from None
    if not isinstance(d, dict) or d.get("format") != ROBUST_FORMAT:
        raise ConfigError(f"{where}: not a {ROBUST_FORMAT} file")
    _policy_parameters({"index": d.get("index", {}), "shed_margin": d.get("shed_margin", 0.0)}, where)
    g, f = d.get("tpot_guard"), d.get("flag_fractions")
    if not isinstance(g, dict) or set(g) != set(GUARD_LEVERS):
        raise ConfigError(f"{where}: tpot_guard: expected {{budget_u, budget_bmin}}, got {g!r}")
    check_levers(g, f"{where}: tpot_guard", guard=True)   # (their ranges)
    if not isinstance(f, dict) or set(f) != {"budget_frac", "seqs_frac", "threshold_frac"} or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= (2 if k == "threshold_frac" else 1)
            for k, v in f.items()):
        raise ConfigError(f"{where}: flag_fractions: expected budget_frac and seqs_frac in (0, 1], threshold_frac in "
                          f"(0, 2], got {f!r}")
    return d


def levers_for(profile, fractions: dict, guard: Optional[dict] = None) -> dict:
    """The absolute flags (and u, B_min) of ``fractions`` of a profile's own flags, as vLLM takes
    them: the budget within [1, B_max], max_num_seqs <= the budget; a threshold at or above the
    budget is off (0), and a threshold fraction >= 1 leaves the deployment's own threshold."""
    B0, S0 = profile.max_num_batched_tokens, profile.max_num_seqs
    B = int(min(profile.budget_max, max(1, round(fractions["budget_frac"] * B0))))
    S = int(max(1, min(round(fractions["seqs_frac"] * S0), B)))
    lv = {"max_num_batched_tokens": B, "max_num_seqs": S}
    tf = fractions["threshold_frac"]
    if tf < 1.0:   # (>= 1: the deployment's own threshold stays)
        T = int(max(1, round(tf * B0)))
        lv["long_prefill_token_threshold"] = 0 if T >= B else T
    if guard is not None:
        lv.update({k: float(v) for k, v in guard.items()})
    return lv
