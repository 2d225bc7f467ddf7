"""Whether a verify step pays: speculative decoding's cost policy (`"draft_policy": "cost"`, the default), learnt
online as the prefix cache's restore-or-recompute choice is.

A verify step of B sequences yields B tokens plus the drafts it accepts and costs c_v(B); a decode step of them
yields B tokens and costs c_d(B). The verify step pays when (B + accepted) / c_v(B) > B / c_d(B), that is when the
drafts expected to be accepted, summed over its sequences, exceed B (rho(B) - 1), rho = c_v / c_d. On the H200 at
the 8B shape rho is 1.02 at B = 1, 1.19 at 4 and 1.29 at 8 (docs/benchmarks.md, session 47); drafts that are
never accepted (a random model's, a sampled answer's at a high temperature) then cost 11 / 22 / 27 % of the
decode's tokens a second at batch 1 / 4 / 8 (session 48) without this policy.

- A request's expected accepted drafts: until its first verify step, all of its draft (each request is tried once:
  on the CPU a verify step costs ~2.5 decode steps, and a guess below that would never try the drafts that pay
  there); then an exponential average (weight 1 - KEEP to the newest) of those its verify steps accepted, the first
  step's its start. Between its verify steps it drifts back towards PRIOR_ACCEPTED by RECOVERY a token generated,
  so a request whose drafts stopped paying is tried again after some tokens where the prior pays, at a cost
  bounded by how seldom that is.
- rho(B): the loop's measured step times by B (`observe_step`), or `prior_rho` until both were measured at that B.
  A decode step costs what one chained behind another takes (from the end of the one before it: its launch and
  host work hidden), or, while none was chained at B (a verify step may come at every step, so none is), what an
  unchained one takes from its launch. A verify step costs what it adds to a stream of decode steps: from the end of
  the step before it (its drafting and launch are not hidden: it is never chained) to its end, plus what the decode
  step after it takes beyond a decode step's cost (that step cannot be chained behind it either). On the H200 at
  batch 4 the graph of a verify step takes 1.2 x a decode step's and the whole of it ~1.5 x: priced at the first,
  drafts accepted 0.56 a step were verified at 0.84 x the plain tokens a second (docs/benchmarks.md, session 48).
"""
from __future__ import annotations

PRIOR_ACCEPTED = 1.0   # where a request's average drifts back to between its verify steps
KEEP = 0.5             # an average's weight on what it held, at each new sample of a request's accepted drafts
RECOVERY = 0.99        # a request's distance to the prior left after each token it generates without verifying
STEP_KEEP = 0.8        # a step time average's weight on what it held
OUTLIER = 1.5          # a step time sample counts as at most this many times its average


def prior_rho(seqs: int) -> float:
    """c_v / c_d before both were measured at `seqs`: the H200's small-batch figures (1 + 0.036 B)."""
    return 1.0 + 0.036 * seqs


class DraftPolicy:
    """The expected gain of a verify step against its cost; see the module doc."""

    def __init__(self) -> None:
        # ("verify" | "decode" | "decode_alone", sequences) -> average seconds (decode_alone: unchained ones)
        self.step_s: dict[tuple[str, int], float] = {}
        self._open: tuple[int, float] | None = None  # the last verify step (sequences, seconds), until the next step

    @staticmethod
    def expected(req, drafts: int) -> float:
        """The drafts `req`'s next verify step of `drafts` drafts is expected to accept: all of them before its
        first verify step, then its average (the module doc), at most `drafts`."""
        return float(drafts) if req.spec_accepted is None else min(DraftPolicy._average_of(req), float(drafts))

    @staticmethod
    def _average_of(req) -> float:
        """`req`'s average of accepted drafts (it has one), drifted towards the prior by the tokens since."""
        average, at_tokens = req.spec_accepted
        return PRIOR_ACCEPTED + (average - PRIOR_ACCEPTED) * RECOVERY ** max(0, len(req.output) - at_tokens)

    def observe_request(self, req, accepted: int) -> None:
        """A verify step of `req`'s drafts accepted `accepted` of them (before its tokens are taken: recorded at
        the length they and the token after them give it)."""
        average = accepted if req.spec_accepted is None else KEEP * self._average_of(req) + (1.0 - KEEP) * accepted
        req.spec_accepted = (float(average), len(req.output) + accepted + 1)

    def observe_step(self, kind: str, seqs: int, seconds: float, launched_s: float, chained: bool) -> None:
        """A decode or verify step of `seqs` sequences ended `seconds` after the step before it and `launched_s`
        after its launch; chained: a decode step at its ordinary cost (enqueued behind the one before it, or every
        step without overlap scheduling)."""
        if kind == "decode":
            self._average(("decode", seqs) if chained else ("decode_alone", seqs), seconds if chained else launched_s)
        if self._open is not None:  # the step after a verify step: what it took beyond a decode step is the verify's
            verify_seqs, verify_s = self._open
            self._open = None
            usual = self._decode_s(seqs)
            extra = max(0.0, seconds - usual) if kind == "decode" and not chained and usual is not None else 0.0
            self._average(("verify", verify_seqs), verify_s + extra)
        if kind == "verify":
            self._open = (seqs, seconds)

    def _decode_s(self, seqs: int) -> float | None:
        chained = self.step_s.get(("decode", seqs))
        return chained if chained is not None else self.step_s.get(("decode_alone", seqs))

    def _average(self, key: tuple[str, int], seconds: float) -> None:
        """A sample into its average, at most OUTLIER times the average: one step stalled by the host (a
        collection, a slow wakeup) must not move it far. (Regression: one such decode sample, where a workload
        chained few, put rho at 1 for a whole run, and drafts that no step accepted were verified at every step.)"""
        old = self.step_s.get(key)
        self.step_s[key] = seconds if old is None else STEP_KEEP * old + (1.0 - STEP_KEEP) * min(seconds, OUTLIER * old)

    def rho(self, seqs: int) -> float:
        verify, decode = self.step_s.get(("verify", seqs)), self._decode_s(seqs)
        if verify is None or decode is None or decode <= 0.0:
            return prior_rho(seqs)
        return max(1.0, verify / decode)

    def pays(self, seqs: int, expected_accepted: float) -> bool:
        """Whether a verify step of `seqs` sequences expected to accept that many drafts in all beats decode steps
        (strictly: nothing expected never pays, whatever rho)."""
        return seqs + expected_accepted > seqs * self.rho(seqs)
