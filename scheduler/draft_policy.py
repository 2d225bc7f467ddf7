"""Whether a verify step pays: speculative decoding's cost policy (`"draft_policy": "cost"`, the default), learnt
online as the prefix cache's restore-or-recompute choice is.

A verify step of B sequences yields B tokens plus the drafts it accepts and costs c_v(B); a decode step of them
yields B tokens and costs c_d(B). The verify step pays when (B + accepted) / c_v(B) >= B / c_d(B), that is when the
drafts expected to be accepted, summed over its sequences, reach B (rho(B) - 1), rho = c_v / c_d. On the H200 at
the 8B shape rho is 1.02 at B = 1, 1.19 at 4 and 1.29 at 8 (docs/benchmarks.md, session 47); drafts that are
never accepted (a random model's, a sampled answer's at a high temperature) then cost 11 / 22 / 27 % of the
decode's tokens a second at batch 1 / 4 / 8 (session 48) without this policy.

- A request's expected accepted drafts: an exponential average (weight 1 - KEEP to the newest) of those its verify
  steps accepted, from PRIOR_ACCEPTED. Between its verify steps it drifts back towards the prior by RECOVERY a
  token generated, so a request whose drafts stopped paying is tried again after some tokens, at a cost bounded
  by how seldom that is.
- rho(B): the loop's measured step times by B (`observe_step`: exponential averages of a verify step's and a
  decode step's seconds; a chained decode step counts from the end of the one before it), or PRIOR_RHO until
  both were measured at that B.
"""
from __future__ import annotations

PRIOR_ACCEPTED = 1.0   # drafts a verify step is expected to accept for a request that has not verified yet
KEEP = 0.5             # an average's weight on what it held, at each new sample of a request's accepted drafts
RECOVERY = 0.99        # a request's distance to the prior left after each token it generates without verifying
STEP_KEEP = 0.8        # a step time average's weight on what it held
MAX_RHO = 1.0 + PRIOR_ACCEPTED  # (a measured ratio above it is taken as it: a request's first verify step still runs)


def prior_rho(seqs: int) -> float:
    """c_v / c_d before both were measured at `seqs`: the H200's small-batch figures (1 + 0.036 B)."""
    return 1.0 + 0.036 * seqs


class DraftPolicy:
    """The expected gain of a verify step against its cost; see the module doc."""

    def __init__(self) -> None:
        self.step_s: dict[tuple[str, int], float] = {}  # ("verify" | "decode", sequences) -> average seconds

    @staticmethod
    def expected(req, drafts: int | None = None) -> float:
        """The drafts `req`'s next verify step is expected to accept (at most `drafts`, when given)."""
        seen = req.spec_accepted
        if seen is None:
            value = PRIOR_ACCEPTED
        else:
            average, at_tokens = seen
            value = PRIOR_ACCEPTED + (average - PRIOR_ACCEPTED) * RECOVERY ** max(0, len(req.output) - at_tokens)
        return value if drafts is None else min(value, float(drafts))

    def observe_request(self, req, accepted: int) -> None:
        """A verify step of `req`'s drafts accepted `accepted` of them (before its tokens are taken: recorded at
        the length they and the token after them give it)."""
        req.spec_accepted = (KEEP * self.expected(req) + (1.0 - KEEP) * accepted, len(req.output) + accepted + 1)

    def observe_step(self, kind: str, seqs: int, seconds: float) -> None:
        key = (kind, seqs)
        old = self.step_s.get(key)
        self.step_s[key] = seconds if old is None else STEP_KEEP * old + (1.0 - STEP_KEEP) * seconds

    def rho(self, seqs: int) -> float:
        verify, decode = self.step_s.get(("verify", seqs)), self.step_s.get(("decode", seqs))
        if verify is None or decode is None or decode <= 0.0:
            return prior_rho(seqs)
        return min(MAX_RHO, max(1.0, verify / decode))

    def pays(self, seqs: int, expected_accepted: float) -> bool:
        """Whether a verify step of `seqs` sequences expected to accept that many drafts in all beats decode steps."""
        return seqs + expected_accepted >= seqs * self.rho(seqs)
