"""The rewards of TokenBatch-v0 (docs/design.md section 5; ``TokenBatchEnv``'s "Rewards"): the reward
modes, one ``REGISTRY`` from which the config's validation (``REWARD_MODES``), the env's docstring
(``rewards_doc``) and the env's step (``RewardMode.count_met``, the compiled kernel's switch) all
read, and ``rewards_kernel``, the compiled step rewards the engine threads write as they advance
the copies."""

from __future__ import annotations

import dataclasses
import textwrap

from .. import bounds
from ..bounds import min_prefill_exceeds
from ..engine import kernel as K
from ..engine._jit import borrow, guard_stale_cache, njit, prefetch


@dataclasses.dataclass(frozen=True)
class RewardMode:
    """A reward mode: its ``name`` (``TokenBatchConfig.reward_mode``), what it counts (``doc``, one
    paragraph of the env's docstring) and ``count_met``: True counts +1 per scored request met in the
    step, False -1 per scored request whose miss became certain in it (``rewards_kernel``)."""

    name: str
    doc: str
    count_met: bool


#: the reward modes by name; the first is ``TokenBatchConfig``'s default
REGISTRY = {m.name: m for m in (
    RewardMode("certain_miss", (
        "minus the number of scored requests whose miss became certain during the step: ended without "
        "being met (shed, timed out, rejected, length capped, late), no first token by arrival + T1, TTFT "
        "unreachable even on an idle engine with every cacheable prefix block cached "
        "(``bounds.min_prefill_ps2``: the minimum prefill time over all chunkings of the tokens not yet "
        "computed), or TPOT unreachable even if every remaining token came one minimum-length iteration "
        "(c0 + c_decode) apart; at truncation every open scored request counts. (The TTFT-unreachable rule "
        "makes a lost request count when it is lost, not at its deadline or when it is shed, so delaying "
        "shedding earns no discounted reward.) Over an episode the rewards sum to -(window - met)."),
        count_met=False),
    RewardMode("met", "+1 per scored request completed within both SLOs.", count_met=True),
)}
#: the valid ``reward_mode`` values
REWARD_MODES = tuple(REGISTRY)


def rewards_doc(indent: str = "    ", width: int = 100) -> str:
    """The reward modes as the env's docstring states them, one paragraph per mode (the default
    first), each line starting with ``indent``."""
    out = []
    for i, m in enumerate(REGISTRY.values()):
        head = f"``{m.name}``" + (" (default)" if i == 0 else "") + ": "
        out.append(textwrap.fill(head + m.doc, width, initial_indent=indent, subsequent_indent=indent,
                                 break_on_hyphens=False))
    return "\n".join(out) + "\n"


@njit
def rewards_kernel(live, trunc, s0, s1, t_min, count_met, now, end_state, first_token, finish, arrival, t1, t2,
                   out_len, gen, capped, certain, met_seen, out, prompt, computed, n_preempt, h_best, ps,
                   budget, open_lo, lo):
    """Step rewards of the ``live`` copies (see ``TokenBatchEnv``, "Rewards"): scored requests [s0, s1)
    whose miss became certain (or, ``count_met``, that were met: the mode's ``RewardMode.count_met``)
    since the last step; ``certain`` and
    ``met_seen`` ([N, s1 - s0]) remember what was counted. A request whose miss is certain, or that
    ended, is settled (nothing it does can count again): ``open_lo[c]`` skips the settled prefix, the
    scan passes over the settled requests behind an open one, and it stops at the first request not
    yet arrived (nothing about it can count before truncation). Copies below ``lo`` are not looked at."""
    # borrowed views (``engine._jit.borrow``): no reference counting per helper call
    live = borrow(live)
    trunc = borrow(trunc)
    now = borrow(now)
    end_state = borrow(end_state)
    first_token = borrow(first_token)
    finish = borrow(finish)
    arrival = borrow(arrival)
    t1 = borrow(t1)
    t2 = borrow(t2)
    out_len = borrow(out_len)
    gen = borrow(gen)
    capped = borrow(capped)
    certain = borrow(certain)
    met_seen = borrow(met_seen)
    out = borrow(out)
    prompt = borrow(prompt)
    computed = borrow(computed)
    n_preempt = borrow(n_preempt)
    h_best = borrow(h_best)
    ps = borrow(ps)
    open_lo = borrow(open_lo)
    n_copies = live.shape[0]
    c_next = 0
    for c in range(lo, n_copies):
        if not live[c]:
            continue
        if c_next <= c:   # prefetch the next copy's scored rows still open
            c_next = K.next_active(live, c)
            if c_next < n_copies and s0 + open_lo[c_next] < s1:
                lo = s0 + open_lo[c_next]
                hi = lo + 32 if lo + 32 < s1 else s1
                for j in range(lo, hi, 8):
                    prefetch(arrival, c_next, j)
                    prefetch(first_token, c_next, j)
                    prefetch(out_len, c_next, j)
                    prefetch(t1, c_next, j)
                    prefetch(t2, c_next, j)
                    prefetch(finish, c_next, j)
                    prefetch(gen, c_next, j)
                    prefetch(prompt, c_next, j)
                    prefetch(computed, c_next, j)
                    prefetch(n_preempt, c_next, j)
                    prefetch(h_best, c_next, j)
                prefetch(end_state, c_next, lo)
                prefetch(capped, c_next, lo)
                prefetch(certain, c_next, lo - s0)
                prefetch(met_seen, c_next, lo - s0)
        t = now[c]
        n = 0
        settled = True   # every request before j is settled
        for j in range(s0 + open_lo[c], s1):
            arr = arrival[c, j]
            if arr > t and not trunc[c]:
                break
            k = j - s0
            if certain[c, k] or met_seen[c, k]:
                # settled (a certain miss can never be met; a met request has ended): skipped, as the
                # scan would find nothing new (it stays behind an open request until that settles)
                if settled:
                    open_lo[c] = k + 1
                continue
            # (from here on the request is unmarked: neither certain nor met_seen)
            es = end_state[c, j]
            ft = first_token[c, j]
            o = out_len[c, j]
            ended = es != K.E_NONE
            met = (es == K.E_COMPLETED and ft - arr <= t1[c, j]
                   and (o <= 1 or finish[c, j] - ft <= t2[c, j] * (o - 1 if o > 1 else 1)))
            ttft_lost = ft < 0 and arr <= t and t > arr + t1[c, j]
            if ft < 0 and arr <= t and not ended and not ttft_lost:
                # TTFT unreachable: even an idle engine, with every cacheable prefix block cached,
                # could not emit the first token by arrival + T1 (the analogue of tpot_lost)
                n_tok = prompt[c, j]
                h = h_best[c, j] if h_best[c, j] > computed[c, j] else computed[c, j]
                if n_preempt[c, j] > 0:   # it may re-hit its own cached blocks: all but one token
                    h = n_tok - 1
                if h > n_tok - 1:
                    h = n_tok - 1
                if h < 0:
                    h = 0
                ttft_lost = min_prefill_exceeds(n_tok, h, ps[0], ps[1], ps[2], ps[3], budget, arr + t1[c, j] - t)
            tpot_lost = (ft >= 0 and not ended and o > 1
                         and t + (o - gen[c, j]) * t_min - ft > t2[c, j] * (o - 1))
            lost = ((ended and not met) or ttft_lost or tpot_lost or (capped[c, j] and arr <= t)
                    or (trunc[c] and not ended))
            if count_met:
                if met:
                    n += 1
            elif lost:
                n -= 1
            certain[c, k] = lost
            met_seen[c, k] = met
            if settled:
                if ended or lost:
                    open_lo[c] = k + 1
                else:
                    settled = False
        out[c] = n


# (last: every compiled function of this module is defined) ``rewards_kernel`` links the engine's
# constants and the upper bound's ``min_prefill_exceeds``: flush its cached machine code when any of
# their sources changes
guard_stale_cache([rewards_kernel], tag="envs.rewards", extra_sources=[bounds.__file__])
