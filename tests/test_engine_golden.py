"""Hand-computed cases, one per engine rule (docs/design.md section 3). Profile `linear`:
t = 5 ms + 0.05 ms per scheduled token, block size 16."""

import numpy as np

from tokenbatch_env.engine import kernel as K
from engine_helpers import run, tiny_trace

MS = 1_000_000


def test_single_request_token_timing():
    r = run(tiny_trace([0], [100], [3]))
    rec, it = r.records(0), r.iterations(0)
    # prefill 100 tokens: 5 + 5 ms; each decode 5.05 ms; tokens at iteration END times
    assert rec["first_token_ns"][0] == 10 * MS
    assert rec["finish_ns"][0] == 10 * MS + 2 * 5_050_000
    assert list(it["prefill_tokens"]) == [100, 0, 0] and list(it["decodes"]) == [0, 1, 1]
    assert rec["end_state"][0] == K.E_COMPLETED
    assert rec["tpot_ns"][0] == 5_050_000


def test_chunked_prefill_running_first():
    r = run(tiny_trace([0, 0], [100, 10], [2, 2]), max_num_batched_tokens=64)
    it = r.iterations(0)
    # it0: A gets the whole budget (64); it1: A's remaining 36 first, then B's 10 is admitted
    assert list(it["prefill_tokens"]) == [64, 46, 0]
    assert list(it["scheduled_reqs"]) == [1, 2, 2]
    rec = r.records(0)
    assert list(rec["first_token_iteration"]) == [1, 1]


def test_arrival_visible_only_at_iteration_start():
    # B arrives 1 ns after iteration 0 starts: it joins at iteration 1
    r = run(tiny_trace([0, 1e-6], [16, 16], [2, 1]))
    rec = r.records(0)
    assert rec["first_scheduled_ns"][1] == r.iterations(0)["start_ns"][1]


def test_fcfs_victim_is_tail_and_no_admission_after_preemption():
    # 4 usable blocks of 16; A and B both grow until A needs a third block at iteration 17
    r = run(tiny_trace([0, 0], [16, 16], [40, 40]), num_blocks=5, prefix_caching=False)
    rec, it = r.records(0), r.iterations(0)
    assert list(rec["preemptions"]) == [0, 1]
    assert rec["recomputed_tokens"][1] == 32
    assert it["preempted"][17] == 1 and it["scheduled_reqs"][17] == 1
    # B waits (head-of-line: needs 3 blocks, 1 free) until A finishes at iteration 39
    assert rec["finish_iteration"][0] == 39
    assert it["prefill_tokens"][40] == 33  # B recomputes prompt + 17 generated tokens
    assert rec["finish_iteration"][1] == 40 + 22
    assert (it["blocks_used"] <= 4).all() and (it["blocks_used"] >= 0).all()


def test_resume_rehits_own_cached_block():
    # as above, but A stops earlier so B's first block is still cached when B resumes
    r = run(tiny_trace([0, 0], [16, 16], [20, 40]), num_blocks=5, prefix_caching=True)
    rec, it = r.records(0), r.iterations(0)
    assert rec["preemptions"][1] == 1
    assert rec["finish_iteration"][0] == 19
    # B resumes at iteration 20 with 33 tokens; block 0 re-hits, 17 tokens recomputed
    assert it["prefill_tokens"][20] == 17


def test_resume_without_cache_recomputes_everything():
    r = run(tiny_trace([0, 0], [16, 16], [20, 40]), num_blocks=5, prefix_caching=False)
    assert r.iterations(0)["prefill_tokens"][20] == 33


def test_prefix_hit_shared_chain_caps_at_tokens_minus_one():
    # A and B share a 2-block chain; B arrives after A computed it: B hits 2 blocks
    chains = [[101, 102], [101, 102]]
    r = run(tiny_trace([0, 50], [40, 40], [3, 3], chains=chains))
    it, rec = r.iterations(0), r.records(0)
    b_iter = rec["first_token_iteration"][1]
    assert it["prefill_tokens"][b_iter] == 40 - 32
    # a prompt of exactly 32 tokens can hit at most 1 block ((32 - 1) // 16)
    r2 = run(tiny_trace([0, 50], [32, 32], [3, 3], chains=[[7, 8], [7, 8]]))
    it2, rec2 = r2.iterations(0), r2.records(0)
    assert it2["prefill_tokens"][rec2["first_token_iteration"][1]] == 16


def test_head_of_line_blocking():
    # A (big) heads the queue and does not fit beside R; B (small) would fit but must wait
    trace = tiny_trace([0, 1, 2], [16, 60, 16], [30, 2, 2])
    r = run(trace, num_blocks=5, prefix_caching=False)
    rec = r.records(0)
    # R (request 0) holds blocks; A needs 4 blocks (+0 watermark) > free: blocked; so is B behind it
    assert rec["first_scheduled_ns"][2] >= rec["first_scheduled_ns"][1]


def test_priority_victim_is_lowest_priority_latest_arrival():
    # three requests; the least important (priority 2) is preempted first
    trace = tiny_trace([0, 0, 0], [16, 16, 16], [40, 40, 40], prio=[0, 2, 1])
    r = run(trace, policy="priority", num_blocks=7, prefix_caching=False)
    rec = r.records(0)
    assert rec["preemptions"][1] >= 1
    assert rec["preemptions"][0] == 0
    # priority order of service: request 0 finishes first
    assert rec["finish_ns"][0] == rec["finish_ns"].min()


def test_length_capping_and_rejection():
    # linear: max_model_len = min(4096, 511 * 16) = 4096
    r = run(tiny_trace([0, 0], [4000, 4096], [200, 5]))
    rec = r.records(0)
    assert rec["end_state"][0] == K.E_LENGTH_CAPPED and rec["output_tokens"][0] == 96
    assert rec["end_state"][1] == K.E_REJECTED
    assert not rec["met"].any()


def test_client_timeout():
    # B waits behind A's long prefill on a 64-token budget; it times out after 10 ms
    r = run(tiny_trace([0, 0], [640, 16], [2, 2]), max_num_batched_tokens=64, max_wait_ms=10)
    rec = r.records(0)
    assert rec["end_state"][1] == K.E_TIMED_OUT
    assert rec["first_token_ns"][1] == -1
    assert rec["end_state"][0] == K.E_COMPLETED


def test_async_scheduling_frees_one_iteration_later():
    # A finishes at iteration 1; B (2 blocks) needs A's blocks; C keeps iteration 2 non-empty
    trace = tiny_trace([0, 0, 1], [16, 16, 32], [2, 10, 2])
    sync = run(trace, num_blocks=5, async_scheduling=False, prefix_caching=False).records(0)
    asy = run(trace, num_blocks=5, async_scheduling=True, prefix_caching=False).records(0)
    assert sync["finish_iteration"][0] == asy["finish_iteration"][0] == 1
    assert sync["first_token_iteration"][2] == 2
    assert asy["first_token_iteration"][2] == 3


def test_async_nothing_running_waits_for_pending_frees():
    # with nothing else running, B must not be rejected while A's blocks are pending
    asy = run(tiny_trace([0, 1], [16, 48], [2, 2]), num_blocks=5, async_scheduling=True,
              prefix_caching=False).records(0)
    assert asy["end_state"][1] == K.E_COMPLETED


def test_empty_and_one_request_traces():
    from tokenbatch_env.traces import Trace
    empty = Trace.build(arrival_ns=np.zeros(0, np.int64), prompt_tokens=np.zeros(0, np.int64),
                        output_tokens=np.zeros(0, np.int64))
    r = run(empty)
    assert len(r.records(0)["arrival_ns"]) == 0
    r = run(tiny_trace([5], [1], [1]))
    rec = r.records(0)
    assert rec["first_token_ns"][0] == rec["finish_ns"][0] == 5 * MS + 5_050_000
    assert rec["tpot_ns"][0] == 0


# ------------------------------------------------------------------ beyond vLLM (rule 11), off by default
def test_skip_hol_admits_the_small_request_behind_a_blocked_one():
    trace = tiny_trace([0, 1, 2], [16, 60, 16], [30, 2, 2])
    hol = run(trace, num_blocks=5, prefix_caching=False).records(0)
    skip = run(trace, num_blocks=5, prefix_caching=False, skip_hol=True).records(0)
    # R holds 2 blocks after decoding; A (needs 4) blocks; B (needs 1) is admitted past it
    assert hol["first_scheduled_ns"][2] >= hol["first_scheduled_ns"][1]
    assert skip["first_scheduled_ns"][2] < skip["first_scheduled_ns"][1]


def test_waiting_request_preempts_lower_score_running_one():
    from tokenbatch_env.policies import engine_policy
    # EDF: B arrives later with a much earlier deadline; A holds the blocks B needs
    trace = tiny_trace([0, 5], [48, 48], [60, 2], t1_ms=10_000, t2_ms=1_000)
    trace = trace.replace(ttft_slo_ns=np.array([10_000, 20], np.int64) * MS)
    edf = engine_policy("edf", t_ref_ms=100.0)
    plain = run(trace, edf, num_blocks=5, prefix_caching=False).records(0)
    pre = run(trace, edf, num_blocks=5, prefix_caching=False, waiting_preempts=True).records(0)
    assert plain["preemptions"][0] == 0 and plain["first_token_ns"][1] > plain["finish_ns"][0] - 1
    assert pre["preemptions"][0] == 1
    assert pre["first_token_ns"][1] < pre["finish_ns"][0]


def test_admission_control_refuses_hopeless_arrivals():
    # ten 1000-token prompts at once, T1 = 200 ms; at 0.05 ms/token (+5 ms / 2048) only ~3 fit
    trace = tiny_trace([0] * 10, [1000] * 10, [2] * 10, t1_ms=200, t2_ms=1000)
    off = run(trace).records(0)
    on = run(trace, admission_control=True).records(0)
    assert (off["end_state"] == K.E_COMPLETED).all()
    refused = on["end_state"] == K.E_REJECTED
    assert 0 < refused.sum() < 10 and refused[-1] and not refused[0]
    assert on["met"].sum() >= off["met"].sum()


def test_swap_preemption_keeps_computed_tokens_and_charges_pcie_time():
    # as the FCFS victim case: B is preempted at iteration 17, but swapped out instead of dropped
    trace = tiny_trace([0, 0], [16, 16], [40, 40])
    rec_r = run(trace, num_blocks=5, prefix_caching=False).records(0)
    r = run(trace, num_blocks=5, prefix_caching=False, swap=True)
    rec, it = r.records(0), r.iterations(0)
    assert rec["preemptions"][1] == 1 and rec["swapped_blocks"][1] == 2
    assert rec["recomputed_tokens"][1] == 0 and rec_r["recomputed_tokens"][1] == 32
    # linear profile: block = 16 tokens x 524288 B = 8 MiB; PCIe 25 GB/s -> 335,544.32 ns per block
    per_block_ps = round(16 * 524288 / 25.0 * 1000)
    decode_1 = 5_000_000 + 50_000  # one decode: 5 ms + 0.05 ms
    assert it["end_ns"][17] - it["start_ns"][17] == -(-(decode_1 * 1000 + 2 * per_block_ps) // 1000)
    # B swaps back in (3 blocks needed for its 33 tokens; free after A finishes at 39) and decodes at
    # once: no recompute prefill
    assert it["prefill_tokens"][40] == 0 and it["decodes"][40] == 1
    # same iterations, less time: two 8 MiB copies each way (1.34 ms) beat recomputing 32 tokens
    # (1.6 ms) on this profile
    assert rec["finish_iteration"][1] == rec_r["finish_iteration"][1]
    assert rec["finish_ns"][1] < rec_r["finish_ns"][1]


def test_swap_falls_back_to_recompute_without_host_memory():
    trace = tiny_trace([0, 0], [16, 16], [40, 40])
    rec = run(trace, num_blocks=5, prefix_caching=False, swap=True, swap_space_gib=0.0).records(0)
    assert rec["swapped_blocks"][1] == 0 and rec["recomputed_tokens"][1] == 32


def test_score_victim_already_scheduled_gives_back_its_tokens():
    from tokenbatch_env.policies import engine_policy
    # A alone at iteration 0, B and C from iteration 1: running order [A, B, C]. At iteration 18 A
    # (latest deadline) is scheduled first, then B needs a block with none free (7 usable): the EDF
    # victim is A, already scheduled, so A gives its token and budget back
    trace = tiny_trace([0, 0.001, 0.001], [20, 16, 16], [60, 20, 20], t1_ms=100, t2_ms=1000)
    trace = trace.replace(ttft_slo_ns=np.array([10_000, 100, 100], np.int64) * MS)
    r = run(trace, engine_policy("edf", t_ref_ms=100.0), num_blocks=8, prefix_caching=False)
    rec, it = r.records(0), r.iterations(0)
    assert it["preempted"][18] == 1 and it["scheduled_reqs"][18] == 2 and it["decodes"][18] == 2
    assert list(rec["preemptions"]) == [1, 0, 0]
    assert rec["recomputed_tokens"][0] == 37  # 20 prompt + 17 decoded before iteration 18
    # under FCFS the tail (C) would be the victim instead
    f = run(trace, num_blocks=8, prefix_caching=False).records(0)
    assert f["preemptions"][0] == 0 and f["preemptions"][2] >= 1
