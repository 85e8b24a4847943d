"""Shipped suites, manifests, the cache and `tokenbatch traces generate` (tokenbatch_env.traces.suites)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from importlib import resources

import numpy as np
import pytest

from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.errors import ConfigError
from tokenbatch_env.traces import suites as S
from tokenbatch_env.traces.io import load_npz
from tokenbatch_env.traces.suites import (
    ManifestMismatchError, compute_manifest, generate_command, list_suites, load_suite,
    load_suite_spec, regenerate_manifest)

SHIPPED = ["azure-code-like", "azure-conv-like", "mooncake-like", "mooncake-like-long", "seed-200"]
DATA = resources.files("tokenbatch_env") / "data" / "suites"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBATCH_CACHE", str(tmp_path / "cache"))


def small_spec(tmp_path, name="tiny", **changes):
    d = json.loads((DATA / "seed-200.json").read_text())
    d["name"] = name
    d["splits"] = [{"name": "train", "count": 3}, {"name": "test", "count": 2}]
    d["generator"]["num_requests"] = 30
    d.update(changes)
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(d))
    return p


def test_shipped_suites_listed():
    assert list_suites() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_suite_regenerates_to_its_manifest(name):
    suite = load_suite(name)
    m = suite.manifest
    assert m["spec_sha256"] == suite.spec.sha256 and isinstance(m["lambda_sat"], dict)
    digests = []
    for split, count in suite.spec.splits:
        traces = suite.traces(split, use_cache=False)
        assert len(traces) == count
        assert [t.digest for t in traces] == m["splits"][split]["digests"]
        digests += m["splits"][split]["digests"]
        assert traces[0].name == f"{name}-{split}-000"
    assert len(set(digests)) == len(digests)  # every trace differs
    t1 = np.concatenate([t.ttft_slo_ns for s in suite.splits for t in suite.traces(s)])
    assert m["t_ref_ns"] == int(np.median(t1)) == suite.t_ref_ns


def test_seed_200_matches_the_brief():
    suite = load_suite("seed-200")
    sp = suite.spec
    assert sp.splits == (("train", 120), ("validation", 40), ("test", 40))
    g = sp.generator
    assert g.num_requests == 400 and g.block_size == 16
    assert (g.arrivals.process, g.arrivals.cv, suite.nominal_rate_rps) == ("gamma", 2.0, 1.0)
    assert (g.lengths.prompt_mu, g.lengths.prompt_sigma, g.lengths.output_mu, g.lengths.output_sigma) == \
        (6.6, 1.0, 5.0, 0.9)
    assert g.lengths.max_model_len == 4096 and g.lengths.truncation == "resample"
    assert g.prefix is not None and 0 < g.prefix.share_fraction < 1
    cls = g.sla.classes
    assert [c.ttft_scale for c in cls] == [2, 5, 10] and [c.tpot_ms for c in cls] == [50, 100, 200]
    assert [c.priority for c in cls] == [0, 1, 2] and g.sla.profile == "stress-512"
    assert suite.predictor == {"kind": "noisy", "sigma": 0.5, "seed": 0}
    assert set(suite.lambda_sat) == {"stress-512", "llama2-7b-a100", "llama3-8b-h100"}  # measured by the engine
    st = suite.manifest["stats"]
    assert st["traces"] == 200 and st["requests"] == 80_000 and st["total_max"] <= 4096
    assert 900 < st["prompt_mean"] < 1000 and 200 < st["output_mean"] < 240
    assert 1.8 < st["gap_cv_mean"] < 2.2 and 0.95 < st["rate_rps_mean"] < 1.05


def test_families_carry_fit_provenance():
    for name in ("azure-conv-like", "azure-code-like", "mooncake-like"):
        d = json.loads((DATA / f"{name}.json").read_text())
        fit = d["provenance"]["fit"]
        assert "../shared/traces" in fit["source"] and fit["tool"].startswith("python tools/fit_families.py")
        assert load_suite_spec(name).splits == (("train", 36), ("validation", 12), ("test", 12))
    assert load_suite_spec("azure-code-like").generator.arrivals.process == "mmpp"
    assert load_suite_spec("mooncake-like").generator.prefix.common_prefix_tokens == 512


def test_mooncake_like_long_is_mooncake_like_at_131072():
    """mooncake-like-long: mooncake-like's fitted numbers (copied, not refitted), lengths truncated
    at llama31-8b-h100's context instead of 4096, SLOs on that profile, its own seed."""
    long, base = load_suite("mooncake-like-long"), load_suite("mooncake-like")
    g, b = long.spec.generator, base.spec.generator
    assert (g.num_requests, g.block_size, g.arrivals, g.prefix) == (b.num_requests, b.block_size, b.arrivals,
                                                                     b.prefix)
    assert g.lengths == dataclasses.replace(b.lengths, max_model_len=131072)
    assert g.lengths.truncation == "resample" and b.lengths.max_model_len == 4096
    assert g.sla == dataclasses.replace(b.sla, profile="llama31-8b-h100")
    assert long.spec.splits == base.spec.splits == (("train", 36), ("validation", 12), ("test", 12))
    assert long.predictor == base.predictor
    used = [set(range(sp.seed, sp.seed + sp.num_traces)) for sp in map(load_suite_spec, SHIPPED)]
    assert sum(map(len, used)) == len(set().union(*used))   # no trace seed shared between suites
    assert g.lengths.max_model_len == load_profile("llama31-8b-h100").max_model_len
    assert long.lambda_sat["llama31-8b-h100"] > 0   # measured by the engine on the suite's profile


def test_mooncake_like_long_keeps_long_prompts_and_fits_llama31():
    """Most prompts exceed 4096 tokens (real Mooncake: 66%), and llama31-8b-h100 rejects or
    length-caps none of them (prompt + output <= 131072)."""
    from tokenbatch_env.engine.state import length_denied

    suite = load_suite("mooncake-like-long")
    traces = [t for s in suite.splits for t in suite.traces(s)]
    p = np.concatenate([t.prompt_tokens for t in traces])
    o = np.concatenate([t.output_tokens for t in traces])
    assert p.size == 24_000 and 0.55 < np.mean(p > 4096) < 0.75
    assert (p + o).max() <= 131072 and p.max() > 100_000
    rejected, capped = length_denied(p, o, load_profile("llama31-8b-h100").max_model_len)
    assert not rejected.any() and not capped.any()
    st = suite.manifest["stats"]
    assert st["total_max"] <= 131072 and 10_000 < st["prompt_mean"] < 13_000   # real Mooncake: 12.0k
    assert load_suite("mooncake-like").manifest["stats"]["prompt_mean"] < 2_100


def test_cache_is_used_checked_and_repaired(tmp_path, monkeypatch):
    suite = load_suite("seed-200")
    first = suite.trace("test", 3)
    path = suite.cache_path("test", 3)
    assert path.is_file() and str(path).startswith(str(tmp_path / "cache"))
    assert load_npz(path).digest == first.digest

    def boom(*a, **k):
        raise AssertionError("regenerated although cached")

    monkeypatch.setattr(S.SuiteSpec, "generate", boom)
    assert suite.trace("test", 3).digest == first.digest  # read from the cache
    monkeypatch.undo()
    monkeypatch.setenv("TOKENBATCH_CACHE", str(tmp_path / "cache"))
    path.write_bytes(b"garbage")  # a corrupted cache entry is regenerated and rewritten
    assert suite.trace("test", 3).digest == first.digest
    assert load_npz(path).digest == first.digest


def test_digest_mismatch_raises(tmp_path):
    p = small_spec(tmp_path)
    regenerate_manifest(str(p))
    mp = tmp_path / "tiny.manifest.json"
    m = json.loads(mp.read_text())
    m["splits"]["train"]["digests"][1] = "0" * 64
    mp.write_text(json.dumps(m))
    suite = load_suite(str(p))
    suite.trace("train", 0)
    with pytest.raises(ManifestMismatchError, match=r"train\[1\]"):
        suite.traces("train")


def test_stale_manifest_is_reported(tmp_path):
    p = small_spec(tmp_path)
    regenerate_manifest(str(p))
    d = json.loads(p.read_text())
    d["generator"]["arrivals"]["cv"] = 3.0
    p.write_text(json.dumps(d))
    with pytest.raises(ManifestMismatchError, match="--write-manifest tiny"):
        load_suite(str(p))


def test_regenerate_manifest_keeps_lambda_sat_only_if_unchanged(tmp_path):
    p = small_spec(tmp_path)
    mp = regenerate_manifest(str(p))
    m = json.loads(mp.read_text())
    assert m["lambda_sat"] == {} and len(m["splits"]["test"]["digests"]) == 2
    m["lambda_sat"] = {"stress-512": 1.5}
    mp.write_text(json.dumps(m))
    regenerate_manifest(str(p))
    assert json.loads(mp.read_text())["lambda_sat"] == {"stress-512": 1.5}
    d = json.loads(p.read_text())
    d["seed"] += 1
    p.write_text(json.dumps(d))
    regenerate_manifest(str(p))
    assert json.loads(mp.read_text())["lambda_sat"] == {}


def test_manifest_text_is_deterministic(tmp_path):
    p = small_spec(tmp_path)
    a = regenerate_manifest(str(p)).read_text()
    assert regenerate_manifest(str(p)).read_text() == a
    assert json.loads(a)["suite_digest"] == compute_manifest(load_suite_spec(str(p)))["suite_digest"]


def test_spec_without_manifest_loads_unverified(tmp_path):
    p = small_spec(tmp_path)
    suite = load_suite(str(p))
    assert not suite.verified
    assert len(suite.digests("test")) == 2


def test_generate_command_writes_npz_and_manifest(tmp_path, capsys):
    out = tmp_path / "out"
    assert generate_command("seed-200", str(out)) == 0
    m = json.loads((out / "manifest.json").read_text())
    shipped = load_suite("seed-200").manifest
    assert m["splits"]["test"]["digests"] == shipped["splits"]["test"]["digests"]
    files = sorted((out / "validation").glob("*.npz"))
    assert len(files) == 40 and files[0].name == "seed-200-validation-000.npz"
    assert load_npz(files[5]).digest == shipped["splits"]["validation"]["digests"][5]
    assert "200 traces" in capsys.readouterr().out


def test_generate_command_writes_nothing_when_a_trace_fails(tmp_path, monkeypatch):
    real = S.Suite.trace

    def trace(self, split, i, **kw):   # the last split's last trace fails its check
        if split == self.splits[-1] and i == len(self.spec.split_range(split)) - 1:
            raise ManifestMismatchError(f"{split} {i}: digest differs")
        return real(self, split, i, **kw)

    monkeypatch.setattr(S.Suite, "trace", trace)
    out = tmp_path / "out"
    with pytest.raises(ManifestMismatchError, match="digest differs"):
        generate_command(str(small_spec(tmp_path)), str(out))
    assert not out.exists() or not any(out.rglob("*"))


def test_cli_generate_into_the_cache_and_from_a_path(tmp_path):
    from tokenbatch_env.cli import main

    p = small_spec(tmp_path)
    assert main(["traces", "generate", str(p)]) == 0
    suite = load_suite(str(p))
    assert suite.cache_path("train", 0).parent.parent.joinpath("manifest.json").is_file()
    assert main(["traces", "generate", "no-such-suite", "--out", str(tmp_path / "x")]) == 2


def test_module_commands(tmp_path, capsys):
    p = small_spec(tmp_path)
    assert S.main(["--write-manifest", str(p)]) == 0
    assert S.main(["--check", str(p)]) == 0
    assert S.main(["--list"]) == 0
    assert "seed-200" in capsys.readouterr().out
    assert S.main(["--check", "nope"]) == 2


@pytest.mark.parametrize("changes, field", [
    (dict(splits=[]), "splits"),
    (dict(splits=[{"name": "a", "count": 1}, {"name": "a", "count": 2}]), "splits"),
    (dict(splits=[{"name": "a", "count": 0}]), "splits[0].count"),
    (dict(seed=-1), "seed"),
    (dict(name="a b"), "name"),
    (dict(predictor={"kind": "psychic"}), "predictor.kind"),
    (dict(predictor={"kind": "noisy", "sigma": -1}), "predictor.sigma"),
    (dict(extra=1), "extra"),
    (dict(version=2), "version"),
])
def test_bad_suite_specs(tmp_path, changes, field):
    p = small_spec(tmp_path, **changes)
    with pytest.raises(ConfigError) as e:
        load_suite(str(p))
    assert field in str(e.value)


def test_unknown_suite_and_split():
    with pytest.raises(ConfigError, match="unknown suite"):
        load_suite("seed-201")
    suite = load_suite("seed-200")
    with pytest.raises(ConfigError, match="unknown split"):
        suite.traces("dev")
    with pytest.raises(ConfigError, match="has 40 traces"):
        suite.trace("test", 40)


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENBATCH_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert S.cache_dir() == tmp_path / ".cache" / "tokenbatch"
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_family_length_fits_reproduce_from_the_real_traces(shared):
    """The shipped numbers are what tools/fit_families.py computes (cheap parts only: lengths and
    the conv arrival CV; the HMM and prefix calibrations run in the tool itself)."""
    import importlib.util
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "fit_families.py"
    spec_ = importlib.util.spec_from_file_location("fit_families", tool)
    fit = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(fit)
    for fam, fname in [("azure-conv-like", "AzureLLMInferenceTrace_conv.csv"),
                       ("azure-code-like", "AzureLLMInferenceTrace_code.csv")]:
        ts, p, o = fit.read_azure(shared("traces", "azure_llm_2023", fname))
        g = load_suite_spec(fam).generator
        want = fit.fit_lengths(p, o)
        assert (g.lengths.prompt_mu, g.lengths.prompt_sigma) == (want["prompt"]["mu"], want["prompt"]["sigma"])
        assert (g.lengths.output_mu, g.lengths.output_sigma) == (want["output"]["mu"], want["output"]["sigma"])
        assert g.lengths.corr == want["corr"]
        assert g.arrivals.rate_rps == fit._sig(len(ts) * 1e9 / (ts[-1] - ts[0]))
        if fam == "azure-conv-like":
            assert g.arrivals.cv == fit._sig(fit.window_gap_cv(ts), 3)
