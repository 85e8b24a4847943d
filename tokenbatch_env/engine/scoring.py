"""Score formulas evaluated inside the engine (DESIGN.md section 4), one definition each.

The kernel calls these for every waiting and running request at the start of each iteration, with
the copy's parameter vector; ``tokenbatch_env.policies`` calls the very same compiled functions for
its vectorised API and the scalar drop-in, so there is one implementation of every formula.

Higher score = served first (and preempted last). Units: ms for service and slack.
"""

from __future__ import annotations

import math

from ._jit import njit

# policy ids (the kernel's MODE_SCORE dispatches on these)
P_EXTERNAL, P_SJF, P_EDF, P_LLF, P_INDEX = 0, 1, 2, 3, 4
POLICY_IDS = {"external": P_EXTERNAL, "sjf": P_SJF, "edf": P_EDF, "llf": P_LLF, "index": P_INDEX}

# index parameter vector layout
(I_KAPPA, I_SLOPE, I_GAMMA, I_THETA, I_BETA, I_W_PREFIX, I_A_EDF, I_T_REF_MS, N_INDEX_PARAMS) = range(9)

Z_CLIP = 50.0


@njit
def expit(x):
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


@njit
def service_ms(p_left, d_left, u_p, u_d):
    """S_i = max(P_i*u_p + d_i*u_d, u_d)."""
    s = p_left * u_p + d_left * u_d
    return s if s > u_d else u_d


@njit
def index_log_score(theta, prefix_ratio, s_ms, d_left, z, first_token_out, kv, blocks_needed,
                    usable_blocks, to_deadline_ms, block_size):
    """The Gittins-barrier index in log space (DESIGN.md section 4)."""
    kappa = theta[I_KAPPA]
    out = math.log(1.0 + theta[I_W_PREFIX] * prefix_ratio) - math.log(s_ms)
    out -= math.log(1.0 + kappa * math.log(1.0 + d_left / block_size))
    if not first_token_out:
        out += math.log(1.0 + theta[I_GAMMA] * expit(-theta[I_SLOPE] * z))
    gap = theta[I_THETA] - kv
    if gap > 0.0:
        out -= theta[I_BETA] * gap * gap * blocks_needed / usable_blocks
    out -= theta[I_A_EDF] * to_deadline_ms / theta[I_T_REF_MS]
    return out


@njit
def policy_score(pid, theta, prefix_ratio, s_ms, d_left, slack_ms, t1_ms, first_token_out, kv,
                 blocks_needed, usable_blocks, to_deadline_ms, deadline_ms, block_size):
    """Score of one request under policy ``pid``."""
    if pid == P_SJF:
        return -s_ms
    if pid == P_EDF:
        return -deadline_ms
    if pid == P_LLF:
        return -slack_ms
    z = slack_ms / t1_ms
    if z > Z_CLIP:
        z = Z_CLIP
    elif z < -Z_CLIP:
        z = -Z_CLIP
    return index_log_score(theta, prefix_ratio, s_ms, d_left, z, first_token_out, kv, blocks_needed,
                           usable_blocks, to_deadline_ms, block_size)


@njit
def idle_prefill_ns(prefill_tokens, computed_before, budget, ps):
    """Idle-engine time (ns) to prefill ``prefill_tokens`` after ``computed_before`` tokens, chunked
    at ``budget``: the exact integer cost model (``ps`` = coefficients in ps). A lower bound on any
    real completion time of that prefill, since every coefficient is >= 0."""
    total = 0
    done = computed_before
    left = prefill_tokens
    while left > 0:
        chunk = left if left < budget else budget
        t = ps[0] + ps[1] * chunk + ps[2] * chunk * chunk + ps[3] * chunk * done
        total += (t + 999) // 1000
        done += chunk
        left -= chunk
    return total


@njit
def idle_prefill_ns_array(prefill_tokens, budget, ps):
    out = prefill_tokens.copy()
    for i in range(prefill_tokens.shape[0]):
        out[i] = idle_prefill_ns(prefill_tokens[i], 0, budget, ps)
    return out
