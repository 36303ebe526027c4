"""No proposer: placeholder drafts whose acceptance the synthetic verifier decides (benchmarks the system).

With ``rejection_sample_method="synthetic"`` and no method, every decoding row
"drafts" K zeros and position i is accepted with the configured conditional
rate, so a run measures what speculation costs and gains at a given acceptance
without a draft model.
"""

from __future__ import annotations

from specjax.spec_decode.proposer import BuildContext, Proposer, register


@register("none")
def build(ctx: BuildContext) -> Proposer:
    del ctx
    return Proposer()
