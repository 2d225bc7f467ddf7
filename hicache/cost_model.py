"""Online cost model: restore a lower-tier hit, or recompute it? (DESIGN.md section 7)

Every direction is a `LinearCost` (hicache/linear_cost.py): `seconds = fixed_s + size * slope`, learned from the last 32
samples. Sizes are bytes for transfers and tokens for recompute; slopes are s/byte and s/token.

Samples must be *recurring* time only: enqueue + queue wait + service (DMA/kernel or file I/O) +
completion. One-time costs (first pinned-workspace allocation, Triton compilation, file creation)
must not be observed: they would inflate the fixed cost of every future decision. Nor may the wait
for the work already on the caller's stream (`Transfer.compute_wait_ns`): a recompute waits for
that forward too.

Recompute is charged at its *marginal* cost `num_tokens * slope`: whether a hit is restored or
recomputed, the uncached tail still runs one forward, so the learned fixed cost of a prefill is paid
either way and is not a saving of a restore. (It is still learned and reported in `state()`.) But
a prompt longer than a prefill chunk (max_prefill_tokens) runs in several forwards, and recomputing
its prefix may take more of them than the tail a restore leaves: those forwards' fixed costs are a
saving of the restore (`decide`'s prompt_tokens and chunk_tokens, `prefill_forwards`).

What the transfer lines do not price (a source's host work, waits and checksums around its
transfers) is learned end to end per source from requests that ran alone (hicache/outcomes.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from hicache.config import HiCacheConfig, Policy
from hicache.cost_memory import CostMemory
from hicache.linear_cost import LinearCost
from hicache.outcomes import OutcomeResiduals

GIB_BYTES = 1 << 30
TRANSFER_DIRECTIONS = ("h2d", "d2h", "s2h", "h2s")
EXPLORE_WRITES = 32  # writes to a tier let ahead of their price while its reads are untimed (`exploring_writes`)


@dataclass(frozen=True)
class Decision:
    """Where a hit comes from. tier "l1": use only the L1 hit and recompute the rest; "l2"/"l3":
    restore `restore_tokens` (= that tier's matched length - l1 matched length) from that tier."""

    tier: str
    restore_tokens: int
    benefit_s: float
    costs: dict
    # what the restores were priced from: (l1, l2, l3 matched tokens, overlap_h2d, l3_taken_on), so
    # that `CostModel.span_s` can price the same path again later with the lines as they are then
    priced: tuple = ()
    failed: bool = False  # the cost model raised as it decided: recompute, counted as failures.cost_model (CostPolicy)


def _restore_tokens(l1_tokens: int, l2_tokens: int, l3_tokens: int) -> dict[str, int]:
    """Tokens an L2 / L3 restore would bring up, beyond what L1 holds (0 for L3 when L2 holds at
    least as much: it is faster)."""
    return {"l2": max(0, l2_tokens - l1_tokens),
            "l3": max(0, l3_tokens - l1_tokens) if l3_tokens > l2_tokens else 0}


def prefill_forwards(uncached_tokens: int, chunk_tokens: int) -> int:
    """Forwards that prefill `uncached_tokens` in chunks of at most `chunk_tokens`: at least one (a
    prompt's last token is always computed, for its first output)."""
    return max(1, -(-uncached_tokens // chunk_tokens))


def _seconds_per_byte(bandwidth_gib_s: float, name: str) -> float:
    if not bandwidth_gib_s > 0:
        raise ValueError(f"{name} must be > 0, got {bandwidth_gib_s}")
    return 1.0 / (bandwidth_gib_s * GIB_BYTES)


class CostModel(CostMemory):
    """Per-direction linear costs plus the restore-vs-recompute decision and write admission.

    Directions: "h2d", "d2h" (priors from host_bandwidth_gib_s), "s2h" (storage read), "h2s"
    (storage write; priors from storage_bandwidth_gib_s), each in s/byte, and "recompute" in s/token
    (prior recompute_us_per_token). Reads and writes of storage are learned separately.
    """

    def __init__(self, config: HiCacheConfig, bytes_per_token: int) -> None:
        self.explore_reads = config.storage_explore_reads
        self.explore_host = config.host_explore_transfers
        self.explore_every = config.restore_explore_every
        self._not_restored = {"l2": 0, "l3": 0}  # hits in a row each tier could have served (cost policy)
        # hits until the next probe, per tier: explore_every, or shorter for one probe after a
        # probe of a charged source came back without its charge (`_follow_probe`)
        self._probe_every = {"l2": self.explore_every, "l3": self.explore_every}
        self._probe_out: dict[str, tuple[int, bool]] = {}  # probed tier -> (interval, charge decided)
        self._backups_refused = 0  # in a row, by backup_worth_its_cost
        self._writes_refused = {"l2": 0, "l3": 0}  # in a row, by worth_writing (its probes)
        self._explore_writes = {"l2": 0, "l3": 0}  # writes let ahead of their price (`exploring_writes`)
        # the last counted worth_writing ask went through as a probe (Backups.start_backup lets its
        # backup go ahead whatever the checks that price the same estimate say)
        self.write_probe = False
        if bytes_per_token < 1:
            raise ValueError(f"bytes_per_token must be >= 1, got {bytes_per_token}")
        if not config.recompute_us_per_token > 0:  # (0: recompute looks free and nothing could correct it)
            raise ValueError("recompute_us_per_token must be > 0")
        self.bytes_per_token = bytes_per_token
        self.margin = config.cost_margin
        host_s_per_byte = _seconds_per_byte(config.host_bandwidth_gib_s, "host_bandwidth_gib_s")
        storage_s_per_byte = _seconds_per_byte(config.storage_bandwidth_gib_s, "storage_bandwidth_gib_s")
        self.directions: dict[str, LinearCost] = {
            "h2d": LinearCost(host_s_per_byte),
            "d2h": LinearCost(host_s_per_byte),
            "s2h": LinearCost(storage_s_per_byte),
            "h2s": LinearCost(storage_s_per_byte),
            "recompute": LinearCost(config.recompute_us_per_token * 1e-6),
        }
        # what each prefix source costs end to end beyond its price (hicache/outcomes.py)
        self.outcomes = OutcomeResiduals() if config.learn_outcomes else None

    # -- learning -------------------------------------------------------------------------------
    # Off in simulations: nothing is timed there, so learning would make recompute look free.
    learning: bool = True

    def observe_transfer(self, direction: str, num_bytes: int, seconds: float) -> None:
        """One transfer's recurring time (enqueue + queue wait + service + completion). Never pass
        one-time costs such as a first pinned-workspace allocation."""
        if direction not in TRANSFER_DIRECTIONS:
            raise ValueError(f"unknown transfer direction {direction!r}; expected one of {TRANSFER_DIRECTIONS}")
        if self.learning:
            self.directions[direction].observe(num_bytes, seconds)
            if direction in ("h2d", "s2h"):  # the tier was just timed: no need to re-explore it
                tier = "l2" if direction == "h2d" else "l3"
                # ... unless its requests are charged an end-to-end overhead (outcomes): an L3
                # restore's H2D re-times L2's price, not that, which only L2's own restores score
                # again (regression: with an L3 restore between any two L2 hits, an L2 charged a
                # 30 ms overhead that went away was never probed, and its hits recomputed for good)
                if tier == "l3" or self._outcome_extra_s(tier) <= 0:
                    self._not_restored[tier] = 0
                self._writes_refused[tier] = 0
            elif direction == "d2h":
                self._backups_refused = 0

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """One prefill forward over `num_tokens` uncached tokens."""
        if self.learning:
            self.directions["recompute"].observe(num_tokens, seconds)

    def observe_outcome(self, source: str, predicted_s: float, actual_s: float) -> None:
        """A request that ran alone took `actual_s` from arrival to its first token, where `span_s`
        prices its path at `predicted_s`; its prefix came from `source` ("l1", "l2", "l3")."""
        if not (self.learning and self.outcomes is not None):
            return
        charged_s = self.outcomes.extra_s(source) if source in self._probe_every else 0.0
        self.outcomes.observe(source, predicted_s, actual_s)
        if source in self._probe_out:
            self._follow_probe(source, actual_s - predicted_s, charged_s)

    def _follow_probe(self, source: str, residual_s: float, charged_s: float) -> None:
        """How soon `source` is probed again, after the first outcome of it scored since a probe
        (`_reexplore`; an outcome is not tagged, so it may be another restore's that finished
        first). Where its charge is what makes a source lose, the charge's window follows an
        overhead that went away only once most of it came from probes: at one probe in
        `explore_every` hits that took ~190-290 hits. So if the charge decided that probe's hit
        (without it the source would have won) and the outcome came back with less than half the
        charge, the next probe comes after half the probe's interval (down to every hit), once:
        a probe always puts the interval back to `explore_every`, so one with no outcome scored
        (requests that never run alone) or a bad one leaves probes as they were, and so does a
        tier that loses on price, whatever its outcomes. A recovered source wins again within ~63 hits."""
        interval, charge_decided = self._probe_out.pop(source)
        relative_s = residual_s - (self.outcomes.residual_s("l1") or 0.0)
        if charge_decided and charged_s > 0 and relative_s < charged_s / 2:
            self._probe_every[source] = max(1, interval // 2)

    def span_s(self, tier: str, priced: tuple, uncached_tokens: int) -> float:
        """Seconds from arrival to the first token for a request whose prefix comes from `tier`,
        priced with the lines as they are now: the restore `decide` priced from `priced` (its
        `Decision.priced`; () for a recompute), plus one prefill of the `uncached_tokens` left,
        fixed cost included. Priced at the first token, not at the decision: a line still
        converging (its first samples of a storage) would otherwise count its lag as overhead."""
        prefill_s = self.directions["recompute"].predict(max(0, uncached_tokens))
        if tier not in ("l2", "l3") or not priced:
            return prefill_s
        l1, l2, l3, overlap_h2d, l3_taken_on = priced
        n = _restore_tokens(l1, l2, l3)[tier]
        return prefill_s + self._restore_price_s(tier, n, l1, l2, l3, overlap_h2d, l3_taken_on)

    def _outcome_extra_s(self, tier: str) -> float:
        return self.outcomes.extra_s(tier) if self.learning and self.outcomes is not None else 0.0

    @property
    def exploring_storage(self) -> bool:
        """Too few timed storage reads to trust the storage estimate yet (cost policy explores)."""
        return self.learning and self.directions["s2h"].learned < self.explore_reads

    def exploring_writes(self, tier: str, count: bool = True) -> bool:
        """Whether a write to `tier` ("l2", "l3") goes ahead of its price, to put something there to read back and
        time: while the tier's reads are untimed (exploring_storage / exploring_host), for its first EXPLORE_WRITES
        such asks (`count`: this ask writes). Past them its price decides, probes included (regression: an L3
        that was never read explored for good, and every one-page backup went ahead of its price: the backups
        session 17 had removed came back whenever an L3 was configured; an L2 that no hit read, likewise)."""
        if not (self.exploring_storage if tier == "l3" else self.exploring_host):
            return False
        if self._explore_writes[tier] >= EXPLORE_WRITES:
            return False
        self._explore_writes[tier] += count
        return True

    def _host_untimed(self, direction: str) -> bool:
        return self.learning and self.directions[direction].learned < self.explore_host

    @property
    def exploring_host(self) -> bool:
        """Fewer than `host_explore_transfers` L1 <-> L2 transfers timed in a direction: the host
        link's priors (host_bandwidth_gib_s) may be far off, and a pessimistic one would refuse the
        backups, and so the restores, that could correct it. The cost policy then backs up until
        both directions are timed, and restores an L2 hit it would have recomputed until one H2D
        is timed (`_reexplore`; the 4B stress workload on the H200 had
        backed up nothing, restored nothing and run at 1.00 x hicache off; docs/benchmarks.md,
        session 19)."""
        return self._host_untimed("d2h") or self._host_untimed("h2d")

    # -- costs ----------------------------------------------------------------------------------
    def _transfer_s(self, direction: str, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0  # nothing moves, no operation, no fixed cost
        return self.directions[direction].predict(num_tokens * self.bytes_per_token)

    def restore_cost_s(self, tier: str, num_tokens: int) -> float:
        """Seconds to bring `num_tokens` into L1 from `tier`: L2 = H2D; L3 = S2H + H2D."""
        if tier == "l2":
            return self._transfer_s("h2d", num_tokens)
        if tier == "l3":
            return self._transfer_s("s2h", num_tokens) + self._transfer_s("h2d", num_tokens)
        raise ValueError(f"restore tier must be 'l2' or 'l3', got {tier!r}")

    def recompute_cost_s(self, num_tokens: int) -> float:
        """Marginal seconds of prefilling `num_tokens` more tokens (see the module docstring)."""
        return max(0, num_tokens) * self.directions["recompute"].slope

    def busy_s(self, prefill_tokens: int, forwards: int) -> float:
        """Seconds of GPU work in `forwards` forwards that prefill `prefill_tokens` tokens in all
        (each forward its fixed cost, the recompute line's intercept): what a restore started now
        would run beside (`decide`'s hidden_s)."""
        return max(0, forwards) * self.directions["recompute"].fixed_s + self.recompute_cost_s(prefill_tokens)

    def break_even_read_fraction(self) -> float:
        """How much of what is backed up to L2 must be read back for the backups to pay: the D2H
        cost per token over what restoring a token saves (recompute's marginal cost minus the H2D).
        1.0 when a restore saves nothing; never below 1 %. (H200, 8B: ~3 / (28 - 3) = 12 %.) The
        reuse gate (hicache/reuse.py) measures it as pages read back per page evicted from L2, which
        stands for pages written once L2 is full (each write then evicts about one page)."""
        per_token = self.bytes_per_token
        write_s = self.directions["d2h"].slope * per_token
        saving_s = self.directions["recompute"].slope - self.directions["h2d"].slope * per_token
        if saving_s <= 0:
            return 1.0
        return min(1.0, max(0.01, write_s / saving_s))

    # -- decisions ------------------------------------------------------------------------------
    def decide(self, l1_tokens: int, l2_tokens: int, l3_tokens: int, policy: Policy = "cost",
               overlap_h2d: bool = False, l3_taken_on: bool = False, lookahead: bool = False,
               hidden_s: float = 0.0, reading_s: float = 0.0, prompt_tokens: int = 0,
               chunk_tokens: int = 0) -> Decision:
        """Pick the source of a prefix hit from cumulative matched lengths per tier.

        An L2/L3 hit only counts beyond l1_tokens. An L3 restore whose first part is already in L2
        reads only the part beyond max(l1, l2) from storage, then moves all of it host->device.
        overlap_h2d: an L2 restore's H2D would land layer by layer under the tail's forward, so it
        costs only what exceeds one forward (the recompute intercept, learned from tail forwards
        that include such copies; counting the H2D in full would charge it twice).
        l3_taken_on: the same for an L3 hit, whose prefetch would be taken on to L1 once its bytes
        landed (an L3 restore started at admission is not: its H2D follows the read). The read is
        charged in full.
        A restore is also charged what its source's requests took end to end beyond this price,
        relative to a recompute's (`outcomes`, hicache/outcomes.py; 0 until its source's is learned).
        lookahead: a prefetch's decision at queue time, which acts on an L3 pick only: it neither
        counts the hit towards a probe nor takes one (`_reexplore`), so a probe of L2 is not spent
        where nothing restores from L2 and a hit is not counted twice. The request's admission
        decides again unless the prefetch was started (its read then restarts the L3 count, and a
        take-on's H2D the L2 count, unless L2 carries an outcome charge). Storage exploration, an
        L3 read, still applies.
        hidden_s: GPU work queued besides this request (`busy_s`), which its restore's reads and
        copies run beside: only the restore's time beyond it delays anyone, while a recompute
        takes GPU time from all of them. Priced alone (hidden_s 0), an L3 read slower than
        recompute was declined under load too, and the cost policy ran at 0.6 x "always" with 8
        requests in flight (H200, docs/benchmarks.md, session 30).
        An overlapped L2 restore (overlap_h2d) hides behind nothing: its request's forward, alone
        in its batch, waits for the copy layer by layer, and the requests queued behind wait for
        that forward (regression: their work was taken to hide an H2D dearer than its recompute).
        reading_s: the storage reads in flight (`OpRunner.reading_s`), which an L3 read queues
        behind: it hides only behind what they leave of hidden_s (regression: each of 20 requests
        queued together priced the others as recomputing, and all of them parked on slow reads,
        one behind the other, while the GPU had nothing to run).
        prompt_tokens, chunk_tokens: the prompt's length and the most tokens one prefill forward takes
        (the engine's max_prefill_tokens); 0, unknown: each option's tail is taken as one forward. A
        recompute's forwards beyond a restore's (`prefill_forwards` of the tokens left uncached by
        each) cost the recompute line's fixed cost each, on the recompute side
        (`{tier}_recompute_forwards_s`): a 3,500-token hit of a 3,513-token prompt is two forwards
        recomputed (2,048 + 1,465) and one restored, an 8,000-token hit four and one; priced at the
        marginal cost only, a restore from a storage a little slower than that recomputed them.
        """
        if min(l1_tokens, l2_tokens, l3_tokens, prompt_tokens, chunk_tokens) < 0:
            raise ValueError("matched lengths, prompt_tokens and chunk_tokens must be >= 0")
        if policy not in ("cost", "always", "never"):
            raise ValueError(f"unknown policy {policy!r}")
        restore_tokens = _restore_tokens(l1_tokens, l2_tokens, l3_tokens)
        costs: dict[str, float] = {}
        benefit_s = {"l1": 0.0}
        for tier in ("l2", "l3"):
            n = restore_tokens[tier]
            if n == 0:
                continue
            restore_s = self._restore_price_s(tier, n, l1_tokens, l2_tokens, l3_tokens, overlap_h2d, l3_taken_on)
            recompute_s = self.recompute_cost_s(n)
            if prompt_tokens and chunk_tokens:  # (the tier's restore leaves prompt_tokens - l1_tokens - n)
                forwards = (prefill_forwards(prompt_tokens - l1_tokens, chunk_tokens)
                            - prefill_forwards(prompt_tokens - l1_tokens - n, chunk_tokens))
                costs[f"{tier}_recompute_forwards_s"] = forwards * self.directions["recompute"].fixed_s
                recompute_s += costs[f"{tier}_recompute_forwards_s"]
            extra_s = self._outcome_extra_s(tier)  # what this source costs beyond its price
            # (an overlapped L2 restore lands under its own tail's forward, which waits for it:
            # nothing else runs beside it, and its price already credits that forward)
            hides_s = (0.0 if overlap_h2d else hidden_s) if tier == "l2" else max(0.0, hidden_s - reading_s)
            benefit_s[tier] = recompute_s - self.margin * max(0.0, restore_s - hides_s) - extra_s
            costs[f"{tier}_restore_s"] = restore_s
            costs[f"{tier}_recompute_s"] = recompute_s
            costs[f"{tier}_extra_s"] = extra_s
            costs[f"{tier}_benefit_s"] = benefit_s[tier]
        if hidden_s > 0:
            costs["hidden_s"] = hidden_s

        if policy == "never":
            tier = "l1"
        elif policy == "always":
            # the longest hit wins; on a tie the faster (shallower) tier
            tier = max(("l2", "l3"), key=lambda t: (restore_tokens[t], t == "l2"))
            if restore_tokens[tier] == 0:
                tier = "l1"
        elif restore_tokens["l3"] and self.exploring_storage:
            tier = "l3"  # learn what a storage read really costs here (see storage_explore_reads)
            costs["explore"] = 1.0
        else:
            tier = "l1"
            for candidate in ("l2", "l3"):  # strict > keeps the faster tier on a tie
                if benefit_s.get(candidate, 0.0) > max(0.0, benefit_s[tier]):
                    tier = candidate
            if not lookahead:
                tier = self._reexplore(tier, restore_tokens, costs)
        return Decision(tier=tier, restore_tokens=restore_tokens.get(tier, 0),
                        benefit_s=benefit_s.get(tier, 0.0), costs=costs,
                        priced=(l1_tokens, l2_tokens, l3_tokens, overlap_h2d, l3_taken_on))

    def _restore_price_s(self, tier: str, n: int, l1_tokens: int, l2_tokens: int, l3_tokens: int,
                         overlap_h2d: bool, l3_taken_on: bool) -> float:
        """A restore of `n` tokens from `tier`, as `decide` prices it (see there)."""
        restore_s = self._transfer_s("h2d", n)
        if overlap_h2d if tier == "l2" else l3_taken_on:
            restore_s = max(0.0, restore_s - self.directions["recompute"].fixed_s)
        if tier == "l3":
            restore_s += self._transfer_s("s2h", l3_tokens - max(l1_tokens, l2_tokens))
        return restore_s

    def _reexplore(self, tier: str, restore_tokens: dict[str, int], costs: dict) -> str:
        """The cost policy's pick, or a tier it has not restored from for `explore_every` hits in a
        row: a restore it skipped is never timed, so an estimate that went wrong (samples taken
        while the link was busy, a page cache that warmed since) would otherwise stay wrong. That
        holds for a tier that loses to recompute and for one that loses to the other tier (an L3
        hit whose shorter L2 part wins every time). At most one probe per tier in `explore_every`
        decisions, or sooner after a probe of a charged source that came back without the charge
        (`_follow_probe`; L2's and L3's may fall due together, on consecutive decisions); any timed
        transfer of the tier's line restarts its count (an L3 restore's H2D restarts L2's), except an
        H2D while L2 carries an outcome charge (`observe_transfer`). And
        while no restore from host memory has been timed (see exploring_host) every L2 hit is a
        probe. Counted once per admission attempt (a request waiting for memory is decided again
        on each loop turn); a prefetch's decision at queue time is a `lookahead` and not counted."""
        if tier == "l1" and restore_tokens["l2"] and self._host_untimed("h2d"):
            costs["explore"] = 1.0
            return "l2"
        if not (self.learning and self.explore_every):
            return tier
        losers = [t for t in ("l2", "l3") if restore_tokens[t] and t != tier]
        for candidate in losers:
            self._not_restored[candidate] += 1
        stale = [t for t in losers if self._not_restored[t] >= self._probe_every[t]]
        if not stale:
            return tier
        probe = stale[0]
        self._not_restored[probe] = 0
        # would it have won without its outcome charge? (`_follow_probe`)
        uncharged_s = costs[f"{probe}_benefit_s"] + costs[f"{probe}_extra_s"]
        charge_decided = uncharged_s > max(0.0, costs.get(f"{tier}_benefit_s", 0.0))
        self._probe_out[probe] = (self._probe_every[probe], charge_decided)
        self._probe_every[probe] = self.explore_every
        costs["explore"] = 1.0
        return probe

    def worth_writing(self, tier: str, num_tokens: int, probe: bool = True, hidden_s: float = 0.0,
                      reading_s: float = 0.0) -> bool:
        """Admission for a backup into `tier` ("l2" or "l3") of `num_tokens` tokens.

        False when a restore from that tier can never beat recompute at its slope-only price, even
        with zero fixed cost (so a later, longer hit would not amortise it either): margin *
        slope-only restore cost of num_tokens >= recompute cost of num_tokens, with the current
        slope estimates. (`decide` may still credit an overlapped H2D or an outcome residual below
        zero; writes are judged without either.) While the storage speed is still being explored,
        L3 writes are admitted, and L2 writes while the host link is (something must be read back
        to time it: `exploring_writes`, a few). And after `explore_every` refusals in a row one write goes through,
        as a probe (`probe`: count this ask; False for a look that writes nothing): a refused tier is never
        read back, so its estimate would never be timed again (regression: one slow H2D estimate
        stopped every L2 write for good). Such a probe sets `write_probe`.
        hidden_s: as for `decide`, the GPU work that a restore of these tokens would run beside
        (the load now stands for the load when it is read back), less for L3 the storage reads in
        flight (`reading_s`, as for `decide`).
        """
        if tier not in ("l2", "l3"):
            raise ValueError(f"write tier must be 'l2' or 'l3', got {tier!r}")
        if probe:
            self.write_probe = False
        if num_tokens <= 0:
            return False
        if self.exploring_writes(tier, count=probe):
            return True
        num_bytes = num_tokens * self.bytes_per_token
        restore_s = num_bytes * self.directions["h2d"].slope
        if tier == "l3":
            restore_s += num_bytes * self.directions["s2h"].slope
            hidden_s = max(0.0, hidden_s - reading_s)
        if self.margin * max(0.0, restore_s - hidden_s) < self.recompute_cost_s(num_tokens):
            if probe:  # (refusals "in a row": an admitted write ends the row; it ran on across them)
                self._writes_refused[tier] = 0
            return True
        if probe and self.learning and self.explore_every:
            self._writes_refused[tier] += 1
            if self._writes_refused[tier] >= self.explore_every:
                self._writes_refused[tier] = 0
                self.write_probe = True
                return True
        return False

    def backup_worth_its_cost(self, new_tokens: int) -> bool:
        """Does an L1 -> L2 backup of `new_tokens` more tokens (beyond what L2 holds) cost less than
        the recompute one read of them saves? Its D2H is charged whole, fixed cost included (the
        enqueue, the gather, the completion: ~1.5 ms for one page on the H200); its saving is
        recompute's marginal cost minus the H2D, per token. With one-token pages every hit would
        otherwise back up its one new token (a unique suffix, rarely read again): on the stress
        workload 72 extra backups, each ~0.5 ms of loop time before the next request
        (docs/benchmarks.md, session 17). Long extensions (a conversation's next turn) pass."""
        if new_tokens <= 0:
            return False
        if self.exploring_writes("l2", count=False):  # (the backup's worth_writing("l2") counts it)
            return True
        saving_s = new_tokens * (self.directions["recompute"].slope
                                 - self.directions["h2d"].slope * self.bytes_per_token)
        if self._transfer_s("d2h", new_tokens) < saving_s:
            self._backups_refused = 0  # (in a row, as worth_writing's)
            return True
        # refused: D2H is timed only by backups, so after `explore_every` refusals in a row one
        # goes ahead as a probe (a D2H estimate that went wrong would otherwise refuse them for good)
        self._backups_refused += 1
        if self.learning and self.explore_every and self._backups_refused >= self.explore_every:
            self._backups_refused = 0
            return True
        return False

    def state(self) -> dict:
        """For status(): every direction's fit, plus effective GiB/s of the transfer slopes."""
        directions = {}
        for name, cost in self.directions.items():
            entry = cost.state()
            if name in TRANSFER_DIRECTIONS:
                entry["gib_s"] = 1.0 / (cost.slope * GIB_BYTES) if cost.slope > 0 else None
            else:
                entry["us_per_token"] = cost.slope * 1e6
            directions[name] = entry
        return {"bytes_per_token": self.bytes_per_token, "margin": self.margin, "directions": directions,
                "outcomes": None if self.outcomes is None else self.outcomes.state(),
                "probe_every": dict(self._probe_every)}
