"""The batched continuous-batching engine: state, step, KV pool, cost model, profiles."""
