"""Trace suites: shipped specs, manifests of digests, deterministic generation and a cache.

A **suite** is package data: ``tokenbatch_env/data/suites/<name>.json`` (the spec) and
``<name>.manifest.json`` (what the spec generates: one content digest per trace, summary
statistics, and ``lambda_sat`` per engine profile, filled by the engine's saturation measurement).
Generated trace files are never shipped: ``Suite.traces(split)`` regenerates them when absent from
the cache directory (``$TOKENBATCH_CACHE``, else ``~/.cache/tokenbatch``), and every trace, cached
or fresh, is checked against the manifest's digest; a mismatch raises ``ManifestMismatchError``.

Spec format (JSON)::

    {"name": "seed-200", "format": "tokenbatch-suite-spec", "version": 1,
     "description": "...", "seed": 2000000,
     "splits": [{"name": "train", "count": 120}, {"name": "validation", "count": 40}, ...],
     "generator": { ...a generators.TraceSpec... },
     "predictor": {"kind": "noisy", "sigma": 0.5, "seed": 0},
     "provenance": { ...free text: where every number came from... }}

Trace ``j`` of the suite (counting through the splits in order) is
``generate_trace(generator, seed + j)``, named ``<suite>-<split>-<i:03d>``. Traces are stored at the
generator's nominal rate (``nominal_rate_rps`` = ``generator.arrivals.rate_rps``); loads are
applied at run time with ``windows.scale_to_rate(trace, rho * lambda_sat, nominal_rps=...)``.

Commands::

    tokenbatch traces generate seed-200 [--out DIR]       # write a suite's NPZ files + manifest
    python -m tokenbatch_env.traces.suites --check NAME   # regenerate and compare with the manifest
    python -m tokenbatch_env.traces.suites --write-manifest NAME [NAME ...] | --all
                                                           # after a deliberate generator/spec change

``--write-manifest`` keeps the recorded ``lambda_sat`` only if every digest is unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .._io import write_text_atomic
from ..errors import ConfigError, TokenBatchError
from .checks import check_keys, num
from .generators import GENERATOR_VERSION, TraceSpec, generate_trace
from .trace import Trace

__all__ = ["SPEC_FORMAT", "MANIFEST_FORMAT", "SuiteSpec", "Suite", "ManifestMismatchError",
           "list_suites", "load_suite", "load_suite_spec", "compute_manifest", "manifest_path",
           "regenerate_manifest", "cache_dir", "generate_command", "main"]

SPEC_FORMAT = "tokenbatch-suite-spec"
MANIFEST_FORMAT = "tokenbatch-suite-manifest"
SPEC_VERSION = 1
MANIFEST_VERSION = 1
PREDICTOR_KINDS = ("oracle", "noisy", "prior")


class ManifestMismatchError(TokenBatchError):
    """A generated or cached trace does not have the digest the suite's manifest records."""


def _round6(x: float) -> float:
    return float(f"{float(x):.6g}")


def _data_dir():
    return resources.files("tokenbatch_env") / "data" / "suites"


def list_suites() -> list[str]:
    """Names of the shipped suites."""
    return sorted(p.name[:-5] for p in _data_dir().iterdir()
                  if p.name.endswith(".json") and not p.name.endswith(".manifest.json"))


def cache_dir() -> Path:
    """``$TOKENBATCH_CACHE`` or ``~/.cache/tokenbatch``."""
    env = os.environ.get("TOKENBATCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenbatch"


# ---------------------------------------------------------------------------------------- spec
@dataclasses.dataclass(frozen=True)
class SuiteSpec:
    name: str
    seed: int
    splits: tuple                       # ((split name, count), ...) in generation order
    generator: TraceSpec
    predictor: dict
    description: str = ""
    provenance: Any = None

    @classmethod
    def from_dict(cls, d: Any, where: str = "suite") -> "SuiteSpec":
        try:
            return cls._from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def _from_dict(cls, d: Any) -> "SuiteSpec":
        check_keys(d, "spec", ["name", "seed", "splits", "generator"],
                   ["format", "version", "description", "predictor", "provenance"])
        if d.get("format", SPEC_FORMAT) != SPEC_FORMAT:
            raise ConfigError(f"format: must be {SPEC_FORMAT!r}, got {d.get('format')!r}")
        if d.get("version", SPEC_VERSION) != SPEC_VERSION:
            raise ConfigError(f"version: this code reads version {SPEC_VERSION}, got {d.get('version')!r}")
        name = d["name"]
        if not isinstance(name, str) or not name or any(c in name for c in "/\\ ") or name.startswith("."):
            raise ConfigError(f"name: must be a non-empty name without spaces or slashes, got {name!r}")
        seed = num(d, "seed", "spec", lo=0, hi=2**62, integer=True)
        raw = d["splits"]
        if not isinstance(raw, list) or not raw:
            raise ConfigError("splits: must be a non-empty list of {\"name\", \"count\"}")
        splits = []
        for i, s in enumerate(raw):
            p = f"splits[{i}]"
            check_keys(s, p, ["name", "count"])
            sn = s["name"]
            if not isinstance(sn, str) or not sn or "/" in sn:
                raise ConfigError(f"{p}.name: must be a non-empty string without '/', got {sn!r}")
            splits.append((sn, num(s, "count", p, lo=1, hi=1_000_000, integer=True)))
        names = [s for s, _ in splits]
        if len(set(names)) != len(names):
            raise ConfigError(f"splits: split names must be unique, got {names}")
        gen = TraceSpec.from_dict(d["generator"], "generator")
        pred = d.get("predictor", {"kind": "noisy", "sigma": 0.5, "seed": 0})
        check_keys(pred, "predictor", ["kind"], ["sigma", "seed"])
        if pred["kind"] not in PREDICTOR_KINDS:
            raise ConfigError(f"predictor.kind: must be one of {list(PREDICTOR_KINDS)}, got {pred['kind']!r}")
        pred = dict(pred)
        if pred["kind"] == "noisy":
            pred["sigma"] = num(pred, "sigma", "predictor", lo=0, hi=10)
        elif "sigma" in pred:
            raise ConfigError("predictor.sigma: only valid for kind 'noisy'")
        pred["seed"] = num(pred, "seed", "predictor", lo=0, hi=2**62, integer=True, default=0)
        desc = d.get("description", "")
        if not isinstance(desc, str):
            raise ConfigError("description: must be a string")
        return cls(name, seed, tuple(splits), gen, pred, desc, d.get("provenance"))

    def to_dict(self) -> dict:
        return {"name": self.name, "format": SPEC_FORMAT, "version": SPEC_VERSION,
                "description": self.description, "seed": self.seed,
                "splits": [{"name": s, "count": c} for s, c in self.splits],
                "generator": self.generator.to_dict(), "predictor": dict(self.predictor),
                "provenance": self.provenance}

    @property
    def sha256(self) -> str:
        """Hash of what determines the traces (generator, seed, splits), canonical JSON."""
        core = {"generator": self.generator.to_dict(), "seed": self.seed,
                "splits": [[s, c] for s, c in self.splits], "generator_version": GENERATOR_VERSION}
        return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    @property
    def num_traces(self) -> int:
        return sum(c for _, c in self.splits)

    def split_range(self, split: str) -> range:
        """Global trace indices of ``split``."""
        start = 0
        for s, c in self.splits:
            if s == split:
                return range(start, start + c)
            start += c
        raise ConfigError(f"suite {self.name!r}: unknown split {split!r}; valid: "
                          f"{[s for s, _ in self.splits]}")

    def trace_seed(self, split: str, i: int) -> int:
        r = self.split_range(split)
        if not 0 <= i < len(r):
            raise ConfigError(f"suite {self.name!r}: split {split!r} has {len(r)} traces, index {i} asked")
        return self.seed + r[i]

    def trace_name(self, split: str, i: int) -> str:
        return f"{self.name}-{split}-{i:03d}"

    def generate(self, split: str, i: int) -> Trace:
        return generate_trace(self.generator, self.trace_seed(split, i), name=self.trace_name(split, i))


def _read_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: invalid JSON: {e}") from None


def _is_path(s: str) -> bool:
    return s.endswith(".json") or "/" in s or os.sep in s


def _resolve(name_or_path: str) -> tuple[str, Optional[str], str]:
    """(where, manifest text or None, spec text) for a shipped name or a spec file path."""
    s = str(name_or_path)
    if _is_path(s):
        p = Path(s)
        if not p.is_file():
            raise ConfigError(f"suite spec file {s!r} not found")
        mp = p.with_name(p.name[:-5] + ".manifest.json") if p.name.endswith(".json") else None
        return str(p), (mp.read_text() if mp is not None and mp.is_file() else None), p.read_text()
    res = _data_dir() / f"{s}.json"
    if not res.is_file():
        raise ConfigError(f"unknown suite {s!r}; valid: {', '.join(list_suites())} (or a spec .json path)")
    man = _data_dir() / f"{s}.manifest.json"
    return f"suite {s!r}", (man.read_text() if man.is_file() else None), res.read_text()


def load_suite_spec(name_or_path: str) -> SuiteSpec:
    where, _, text = _resolve(name_or_path)
    return SuiteSpec.from_dict(_read_json(text, where), where)


# ---------------------------------------------------------------------------------------- manifest
def _stats(traces: list[Trace]) -> dict:
    p = np.concatenate([t.prompt_tokens for t in traces])
    o = np.concatenate([t.output_tokens for t in traces])
    rates, cvs = [], []
    for t in traces:
        if len(t) >= 3 and t.arrival_ns[-1] > t.arrival_ns[0]:
            g = np.diff(t.arrival_ns).astype(float)
            rates.append(g.size * 1e9 / g.sum())
            cvs.append(g.std() / g.mean())
    chain = np.concatenate([t.prefix_lengths for t in traces])
    bs = traces[0].block_size
    out = {"traces": len(traces), "requests": int(p.size),
           "prompt_mean": _round6(p.mean()), "prompt_p50": _round6(np.median(p)),
           "prompt_p99": _round6(np.percentile(p, 99)), "prompt_max": int(p.max()),
           "output_mean": _round6(o.mean()), "output_p50": _round6(np.median(o)),
           "output_p99": _round6(np.percentile(o, 99)), "output_max": int(o.max()),
           "total_max": int((p + o).max()),
           "rate_rps_mean": _round6(np.mean(rates)) if rates else None,
           "gap_cv_mean": _round6(np.mean(cvs)) if cvs else None,
           "prefix_request_fraction": _round6(np.mean(chain > 0)),
           "prefix_token_fraction": _round6((chain * bs).sum() / p.sum())}
    if traces[0].has_slos:
        t1 = np.concatenate([t.ttft_slo_ns for t in traces])
        t2 = np.concatenate([t.tpot_slo_ns for t in traces])
        cid = np.concatenate([t.class_id for t in traces])
        out["ttft_slo_ms_p50"] = _round6(np.median(t1) / 1e6)
        out["tpot_slo_ms_mean"] = _round6(t2.mean() / 1e6)
        out["class_fractions"] = [_round6(x) for x in np.bincount(cid) / cid.size]
    return out


def compute_manifest(spec: SuiteSpec, *, lambda_sat: Optional[dict] = None,
                     traces: Optional[dict] = None) -> dict:
    """The manifest of ``spec`` (generates every trace unless ``traces`` {split: [Trace]} is given)."""
    if traces is None:
        traces = {s: [spec.generate(s, i) for i in range(c)] for s, c in spec.splits}
    splits, everything = {}, []
    for s, c in spec.splits:
        ts = traces[s]
        everything += ts
        splits[s] = {"seeds": [spec.trace_seed(s, i) for i in range(c)], "digests": [t.digest for t in ts],
                     "stats": _stats(ts)}
    all_digests = "".join(d for s, _ in spec.splits for d in splits[s]["digests"])
    t1 = np.concatenate([t.ttft_slo_ns for t in everything]) if everything[0].has_slos else None
    return {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "suite": spec.name,
        "spec_sha256": spec.sha256, "generator_version": GENERATOR_VERSION,
        "suite_digest": hashlib.sha256(all_digests.encode()).hexdigest(),
        "nominal_rate_rps": spec.generator.arrivals.rate_rps,
        # T_ref of docs/design.md section 4: the median TTFT SLO over every request of the suite (ns)
        "t_ref_ns": None if t1 is None else int(np.median(t1)),
        "stats": _stats(everything),
        "splits": splits,
        "lambda_sat": dict(lambda_sat or {}),
    }


def _manifest_text(m: dict) -> str:
    return json.dumps(m, indent=1) + "\n"


def _validate_manifest(m: Any, spec: SuiteSpec, where: str) -> dict:
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise ConfigError(f"{where}: not a suite manifest")
    fix = f"run `python -m tokenbatch_env.traces.suites --write-manifest {spec.name}`"
    if m.get("spec_sha256") != spec.sha256:
        raise ManifestMismatchError(f"{where}: the manifest was written for another version of the spec "
                                    f"or generator (spec_sha256 differs); if the change is deliberate, {fix}")
    for s, c in spec.splits:
        d = m.get("splits", {}).get(s, {}).get("digests")
        if not isinstance(d, list) or len(d) != c:
            raise ConfigError(f"{where}: manifest has no {c} digests for split {s!r}; {fix}")
    if not isinstance(m.get("lambda_sat", {}), dict):
        raise ConfigError(f"{where}: lambda_sat must be an object {{profile: value}}")
    return m


# ---------------------------------------------------------------------------------------- suite
@dataclasses.dataclass(frozen=True)
class Suite:
    """A loaded suite: its spec and manifest; traces are generated or read from the cache."""

    spec: SuiteSpec
    manifest: Optional[dict]            # None for a spec file without a manifest (unverified)
    where: str = ""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def splits(self) -> list[str]:
        return [s for s, _ in self.spec.splits]

    @property
    def nominal_rate_rps(self) -> float:
        return self.spec.generator.arrivals.rate_rps

    @property
    def predictor(self) -> dict:
        return dict(self.spec.predictor)

    @property
    def lambda_sat(self) -> dict:
        return dict((self.manifest or {}).get("lambda_sat", {}))

    @property
    def t_ref_ns(self) -> Optional[int]:
        return (self.manifest or {}).get("t_ref_ns")

    @property
    def verified(self) -> bool:
        return self.manifest is not None

    def digests(self, split: str) -> list[str]:
        self.spec.split_range(split)
        if self.manifest is None:
            return [t.digest for t in self.traces(split)]
        return list(self.manifest["splits"][split]["digests"])

    def cache_path(self, split: str, i: int) -> Path:
        return (cache_dir() / "suites" / self.name / self.spec.sha256[:16] / split
                / f"{self.spec.trace_name(split, i)}.npz")

    def trace(self, split: str, i: int, *, use_cache: bool = True) -> Trace:
        """Trace ``i`` of ``split``: from the cache if its digest checks, else regenerated (and
        cached); always checked against the manifest's digest."""
        self.spec.trace_seed(split, i)  # validates split and index
        expected = None if self.manifest is None else self.manifest["splits"][split]["digests"][i]
        path = self.cache_path(split, i)
        if use_cache and expected is not None and path.is_file():
            from .io import load_npz

            try:
                t = load_npz(path)
                if t.digest == expected:
                    return t
            except TokenBatchError:
                pass  # corrupted or stale cache entry: regenerate below
        t = self.spec.generate(split, i)
        if expected is not None and t.digest != expected:
            raise ManifestMismatchError(
                f"{self.where or self.name}: trace {split}[{i}] (seed {self.spec.trace_seed(split, i)}) "
                f"generated with digest {t.digest[:16]}..., the manifest records {expected[:16]}...: this "
                f"numpy/platform does not reproduce the suite (or the manifest is stale; regenerate it "
                f"with `python -m tokenbatch_env.traces.suites --write-manifest {self.name}` only after "
                f"a deliberate generator change)")
        if use_cache and expected is not None:
            from .io import save_npz

            try:
                save_npz(t, path)
            except OSError:
                pass  # a read-only cache is not an error: we just regenerate next time
        return t

    def traces(self, split: str, *, use_cache: bool = True) -> list[Trace]:
        return [self.trace(split, i, use_cache=use_cache) for i in range(len(self.spec.split_range(split)))]

    def all_traces(self, *, use_cache: bool = True) -> dict[str, list[Trace]]:
        return {s: self.traces(s, use_cache=use_cache) for s in self.splits}


def load_suite(name_or_path: str) -> Suite:
    """A shipped suite by name, or a spec JSON file (with ``<stem>.manifest.json`` beside it, if any)."""
    where, man_text, text = _resolve(name_or_path)
    spec = SuiteSpec.from_dict(_read_json(text, where), where)
    manifest = None
    if man_text is not None:
        manifest = _validate_manifest(_read_json(man_text, f"{where} manifest"), spec, f"{where} manifest")
    elif not _is_path(str(name_or_path)):
        raise ConfigError(f"{where}: no manifest shipped; run `python -m tokenbatch_env.traces.suites "
                          f"--write-manifest {spec.name}`")
    return Suite(spec, manifest, where)


def manifest_path(name_or_path: str) -> Path:
    """Where the manifest of a suite lives: ``<stem>.manifest.json`` beside a spec file, or the
    shipped one of a suite name (``tokenbatch_env/data/suites``)."""
    s = str(name_or_path)
    if _is_path(s):
        p = Path(s)
        return p.with_name(p.name[:-5] + ".manifest.json")
    return Path(str(_data_dir() / f"{s}.manifest.json"))


def regenerate_manifest(name_or_path: str) -> Path:
    """Regenerate every trace of the suite and (re)write its manifest; returns the manifest path.

    Keeps the recorded ``lambda_sat`` only if every digest is unchanged (lambda_sat is a property of
    the generated requests; after a change it must be measured again).
    """
    where, man_text, text = _resolve(name_or_path)
    spec = SuiteSpec.from_dict(_read_json(text, where), where)
    old = None
    if man_text is not None:
        try:
            old = json.loads(man_text)
        except json.JSONDecodeError:
            old = None
    new = compute_manifest(spec)
    if isinstance(old, dict):
        same = all(old.get("splits", {}).get(s, {}).get("digests") == new["splits"][s]["digests"]
                   for s in new["splits"])
        if same and isinstance(old.get("lambda_sat"), dict):
            new["lambda_sat"] = old["lambda_sat"]
        elif old.get("lambda_sat"):
            print(f"{spec.name}: digests changed; dropping the recorded lambda_sat "
                  f"(re-measure it)", file=sys.stderr)
    path = manifest_path(name_or_path)
    write_text_atomic(path, _manifest_text(new))
    os.chmod(path, 0o644)  # package data: world-readable like the specs
    return path


# ---------------------------------------------------------------------------------------- commands
def generate_command(spec: str, out: Optional[str]) -> int:
    """``tokenbatch traces generate SPEC [--out DIR]``: write a suite's traces as NPZ + manifest.

    ``SPEC`` is a shipped suite name or a spec JSON path. Traces of a suite with a manifest are
    checked against it. ``DIR`` defaults to the cache directory of the suite (what ``load_suite``
    reads); files are ``DIR/<split>/<suite>-<split>-<i>.npz`` and ``DIR/manifest.json``.
    """
    from .io import save_npz

    from .._io import check_writable

    suite = load_suite(spec)
    base = (suite.cache_path(suite.splits[0], 0).parents[1] if out is None else Path(out))
    check_writable(base, "--out" if out is not None else "the suite's cache directory", directory=True)
    # every split generated (and checked against the manifest) before the first file is written:
    # a trace that fails leaves no partial suite behind
    traces = suite.all_traces(use_cache=out is None)
    manifest = compute_manifest(suite.spec, traces=traces, lambda_sat=suite.lambda_sat)
    for s, split_traces in traces.items():
        for i, t in enumerate(split_traces):
            save_npz(t, base / s / f"{suite.spec.trace_name(s, i)}.npz")
    write_text_atomic(base / "manifest.json", _manifest_text(manifest))
    n = sum(len(v) for v in traces.values())
    state = "verified against the shipped manifest" if suite.verified else "no manifest to verify against"
    print(f"{suite.name}: wrote {n} traces ({', '.join(f'{s} {len(v)}' for s, v in traces.items())}) "
          f"to {base} ({state}); suite digest {manifest['suite_digest'][:16]}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tokenbatch_env.traces.suites",
                                 description="Check or rewrite suite manifests.")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write-manifest", nargs="*", metavar="NAME", help="rewrite these suites' manifests")
    g.add_argument("--check", nargs="*", metavar="NAME", help="regenerate and compare with the manifests")
    g.add_argument("--list", action="store_true", help="list the shipped suites")
    ap.add_argument("--all", action="store_true", help="every shipped suite")
    args = ap.parse_args(argv)
    try:
        if args.list:
            for n in list_suites():
                print(n)
            return 0
        names = list_suites() if args.all else (args.write_manifest or args.check or [])
        if not names:
            ap.error("name a suite or pass --all")
        for n in names:
            if args.write_manifest is not None:
                print(f"wrote {regenerate_manifest(n)}")
            else:
                suite = load_suite(n)
                for s in suite.splits:
                    suite.traces(s, use_cache=False)
                print(f"{n}: all {suite.spec.num_traces} traces match the manifest")
        return 0
    except TokenBatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
