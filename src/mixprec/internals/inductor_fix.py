"""A warm start that does not tune again: torch up to 2.11's inductor re-runs coordinate-descent
tuning of a Triton kernel whose tuned config its autotune cache already holds
(pytorch/pytorch#172819), so the second `experiment=fast` on a machine spent 60 of its 82 s to
the first step tuning again (H200, benchmarks/RESULTS.md). Two lines of
CachingAutotuner.recheck_autotune_cache are at fault, and pytorch/pytorch#173391 fixed them
(newer torch has the fix): the cache is consulted for a kernel of one config too (`> 1` became
`>= 1`), and the cached config's `found_by_coordesc` is carried onto the compiled config that
matches it. `apply()` puts that fixed method in place where the installed torch still has the
bug (found by reading its source), and does nothing elsewhere.

A reduction kernel whose register pressure makes inductor add a half-RBLOCK config after the
cache narrowed it to one would still benchmark again; pytorch/pytorch#181292 skips that step for
a cached winner, and so does the second patch here."""

from __future__ import annotations

import inspect
import logging

from mixprec import internals

log = logging.getLogger("mixprec.models")
BUG = "len(cached_configs) == 1 and len(configs) > 1"
_applied: list[bool] = []


def apply() -> bool:
    """Patch the installed inductor if it has the bug; True if it was (or already is) patched."""
    if _applied:
        return _applied[0]
    if not internals.enabled("inductor_fix"):
        return False
    try:
        from torch._inductor.runtime import triton_heuristics as th

        source = inspect.getsource(th.CachingAutotuner.recheck_autotune_cache)
        needs = BUG in source and hasattr(th.CachingAutotuner, "_dynamic_scale_rblock")
    except (ImportError, AttributeError, OSError, TypeError):
        needs = False
    if needs:
        original_scale = th.CachingAutotuner._dynamic_scale_rblock
        th.CachingAutotuner.recheck_autotune_cache = _recheck_autotune_cache
        th.CachingAutotuner._dynamic_scale_rblock = _skipping_a_tuned_winner(original_scale)
        log.info("inductor: patched its warm start (pytorch/pytorch#172819: no tuning again)")
    _applied.append(needs)
    return needs


def _recheck_autotune_cache(self, reload_kernel_from_src) -> None:
    """torch 2.11's CachingAutotuner.recheck_autotune_cache with pytorch/pytorch#173391."""
    from torch._inductor.runtime import triton_heuristics as th

    assert self.is_statically_launchable()
    configs = [result.config for result in self.compile_results]
    cached, _, info = th.check_autotune_cache(configs, self.filename, self.inductor_meta)
    self.autotune_cache_info = info
    if len(cached) != 1:  # a miss
        return
    best = cached[0]
    found = getattr(best, "found_by_coordesc", False)
    key = th.triton_config_to_hashable(best)
    for result in self.compile_results:
        if th.triton_config_to_hashable(result.config) == key:
            result.config.found_by_coordesc = found  # else run() tunes it again
            self.compile_results = [result]
            return
    if found:  # tuned to a config the saved kernel was not compiled for: compile that one
        with th.dynamo_timed("CachingAutotuner.slow_precompile_config"):
            if self.fn.fn is None:
                self.fn = reload_kernel_from_src().fn
            self.compile_results = [self._precompile_config(best)]


def _skipping_a_tuned_winner(original):
    def _dynamic_scale_rblock(self):
        tuned = len(self.launchers) == 1 and getattr(
            self.launchers[0].config, "found_by_coordesc", False
        )
        if not tuned:
            original(self)

    return _dynamic_scale_rblock
