"""Campaign statistics: what ran, what broke, how to replay it; terminal text and JSON."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Anomaly:
    episode: int
    kind: str  # lost_rows, duplicated_rows, phantom_rows, mismatched_rows, not_converged, ...
    detail: str
    replay: str  # the command that replays this episode alone
    log_tail: str = ""


@dataclass
class Report:
    seed: int
    episodes_planned: int
    episodes: int = 0
    duration_s: float = 0.0
    faults: Counter[str] = field(default_factory=Counter)
    failpoint_attempts: Counter[str] = field(default_factory=Counter)
    failpoint_hits: Counter[str] = field(default_factory=Counter)
    failpoint_not_reached: Counter[str] = field(default_factory=Counter)
    catalogue: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    rows_compared: int = 0
    lost: int = 0
    duplicated: int = 0
    phantom: int = 0
    mismatched: int = 0
    reads_served: int = 0
    reads_refused: int = 0
    reads_failed: int = 0
    reads_outside_ready: int = 0
    transactions: int = 0
    # The workload's rarer write paths (chaos/workload.py): truncates, truncates_refilled
    # (inserts after the TRUNCATE in its transaction), columns_added, and writes of the
    # TOAST table that leave its TOAST column out (upsert_ / update_toast_kept).
    workload: Counter[str] = field(default_factory=Counter)
    # Storage GC (chaos/gc_driver.py): passes, groups, committed, refused_<CODE>, files_replaced,
    # rows_kept, rows_dropped, chain_items, racing_changes, gate_closed, commit_unknown,
    # task_died, task_retried (Spark's retry of a dead rewrite task), retry_committed,
    # retry_refused_<CODE>, streams_skipped, rolled_back_recovery, rolled_back_in_place,
    # promoted (the last three from the journals after each episode).
    gc: Counter[str] = field(default_factory=Counter)
    # Sweepers, reverts and orphans (chaos/sweep.py): rounds_forced, <pass>_removed,
    # reverts, reverted, revert_refused_<CODE>, revert_nothing, orphans_planted,
    # orphans_removed, temporary_planted; from the storage audit after every episode:
    # regular_objects_checked, retired_swept_seen (RETIRED files seen due, then gone).
    sweep: Counter[str] = field(default_factory=Counter)
    # The Spark replay job's recoveries with a task retried (chaos/spark_replay.py):
    # recoveries, task_attempts, tasks_killed, requests_before_kill, tasks_retried,
    # retries_acknowledged (the retry sent everything its vnode's changelog held),
    # requests and rows (acknowledged, by attempts that finished), marked_ready,
    # victim_not_killed (a victim with no request to die after).
    replay: Counter[str] = field(default_factory=Counter)
    # SNAPSHOT_IS_IMMUTABLE (chaos/repeatable_reads.py, stalls.py, split_reads.py):
    # taken_<via>, take_refused_<CODE>, rows_taken, rereads, reread_identical,
    # reread_changed, reread_refused_<CODE>, reread_gate_<CODE>, rows_reread, held_begun,
    # held_ended, held_ended_by_server, ended_by_server, read_ms_<via>; stall_* (stalled
    # writes) and split_* (split reads).
    snapshots: Counter[str] = field(default_factory=Counter)
    # AS OF reads and pins (chaos/as_of_reads.py, pinned_snapshots.py): as_of_reads,
    # as_of_by_<ts|time|pin>, as_of_answered, as_of_identical, as_of_changed, as_of_rows,
    # as_of_refused_expired, as_of_refused_unmapped (and their _age_s sums: seconds since
    # the snapshot was taken; _by_node: refused by a node, not at BeginTrans),
    # as_of_refused_pinned_rebuilt (a pinned S in history a node's recovery rebuilt),
    # as_of_refused_wrongly, as_of_point_moved,
    # as_of_gate_<CODE>, as_of_away_<CODE>; pins_created, pins_read, pins_dropped,
    # pin_create_refused_<CODE>, pin_drop_refused_<CODE>, pin_list_refused_<CODE>.
    history: Counter[str] = field(default_factory=Counter)
    # Primary-key lookups (chaos/key_lookups.py), by where they ran: once healed (no
    # prefix), AS OF (as_of_), during a fault with a node away (fault_down_) or with
    # every node READY (fault_up_): lookups (calls, one per table), keys,
    # keys_<present|deleted|never>, answered, found, refused_<CODE>, wrong (keys).
    lookups: Counter[str] = field(default_factory=Counter)
    # The change feed's follower (chaos/feed_follower.py): reads, commits, changes,
    # changes_<type>, duplicated, wrong_before, out_of_order, lost, rereads,
    # reread_differs, expired, refused_<CODE>, tables_checked.
    feed: Counter[str] = field(default_factory=Counter)
    # The application writer (chaos/app_workload.py): sent, acknowledged, not_sent (failed
    # before its log append), in_doubt_killed (died in the call at a writer.* point),
    # in_doubt_error (failed after its log append), unknown, in_doubt_resolved (applied
    # by a later open), rows_upserted, rows_deleted, starts, opens, open_failed,
    # exit_<code>, stop_killed, node_kills, node_kills_with_rows_to_replay (acknowledged
    # rows of the writer above the killed node's checkpoint), rows_to_replay,
    # cdc_replays, cdc_replays_with_writer (the connector's recoveries that replayed its
    # changelog), rows_compared (its table's expected rows, per comparison),
    # undecided_keys (keys of transactions in doubt or unknown at a comparison) and
    # undecided_applied (of them, those found holding the transaction's value).
    app: Counter[str] = field(default_factory=Counter)
    # The wide table two routed sources fill (chaos/wide.py): transactions (committed),
    # transactions_<small|large|truncate>, transactions_both_sources_one_id, per statement
    # kind its count with an effect and <kind>_noop without one, in_<both|
    # delete_then_write|refill|large>, steps_before_first_commit (the sources left alone
    # until the connector's first commit), bursts and burst_transactions (while an
    # immediate PostgreSQL stop goes on), failed_before_commit; the model's rows_created,
    # rows_merged, deleted_with_other_columns (a source's delete removed the other
    # source's columns too), commit_unknown, unknown_committed, unknown_aborted,
    # status_<in_progress|None> (not resolved yet), unresolved_at_close; rows_compared,
    # undecided_keys.
    wide: Counter[str] = field(default_factory=Counter)
    unexpected_exits: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    anomalies: list[Anomaly] = field(default_factory=list)
    episode_seconds: list[float] = field(default_factory=list)
    converge_seconds: list[float] = field(default_factory=list)
    stopped_early: str = ""

    @property
    def coverage(self) -> float:
        return len(self.failpoint_hits) / len(self.catalogue) if self.catalogue else 0.0

    def never_hit(self) -> list[str]:
        return [p for p in self.catalogue if p not in self.failpoint_hits]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for name, value in vars(self).items():  # asdict mangles Counters into tuple keys
            if isinstance(value, Counter):
                data[name] = dict(sorted(value.items()))
        data["anomaly_count"] = len(self.anomalies)
        data["coverage"] = round(self.coverage, 4)
        data["never_hit"] = self.never_hit()
        data["episode_seconds_mean"] = _mean(self.episode_seconds)
        data["converge_seconds_mean"] = _mean(self.converge_seconds)
        data.pop("episode_seconds")
        data.pop("converge_seconds")
        return data

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2, default=str))

    def text(self) -> str:
        lines = [
            f"chaos campaign seed={self.seed}: {self.episodes}/{self.episodes_planned} episodes "
            f"in {self.duration_s:.0f}s (mean episode {_mean(self.episode_seconds):.2f}s, "
            f"mean converge {_mean(self.converge_seconds):.2f}s)",
            f"  source transactions  {self.transactions} (" + (", ".join(
                f"{k}={v}" for k, v in sorted(self.workload.items())) or "-") + ")",
            "  faults               " + ", ".join(f"{k}={v}" for k, v in
                                                  sorted(self.faults.items())),
            f"  failpoints hit       {len(self.failpoint_hits)}/{len(self.catalogue)} "
            f"(coverage {self.coverage:.0%}; attempts {sum(self.failpoint_attempts.values())}, "
            f"not reached {sum(self.failpoint_not_reached.values())})",
            f"  never hit            {', '.join(self.never_hit()) or '-'}",
            "  left out             " + (", ".join(f"{k} ({v})" for k, v in
                                                   self.unreachable.items()) or "-"),
            f"  storage GC           {self.gc_text()}",
            "  sweepers             " + (", ".join(f"{k}={v}" for k, v in
                                                   sorted(self.sweep.items())) or "-"),
            f"  Spark replay retries {self.replay_text()}",
            f"  application writer   {self.app_text()}",
            "  wide table (routes)  " + (", ".join(f"{k}={v}" for k, v in
                                                   sorted(self.wide.items())) or "-"),
            f"  rows compared        {self.rows_compared}",
            f"  lost / duplicated / phantom / mismatched rows  {self.lost} / {self.duplicated} "
            f"/ {self.phantom} / {self.mismatched}",
            f"  reads served         {self.reads_served} (refused by the gate "
            f"{self.reads_refused}, failed after admission {self.reads_failed})",
            f"  reads outside READY  {self.reads_outside_ready}",
            *self.snapshot_lines(),
            *self.history_lines(),
            f"  unexpected exits     {len(self.unexpected_exits)}",
        ]
        lines += [f"    {u}" for u in self.unexpected_exits[:20]]
        lines += [f"  note: {n}" for n in self.notes[:20]]
        if self.stopped_early:
            lines.append(f"  stopped early: {self.stopped_early}")
        lines.append(f"  ANOMALIES            {len(self.anomalies)}")
        for a in self.anomalies:
            lines.append(f"    episode {a.episode} {a.kind}: {a.detail}")
            lines.append(f"      replay: {a.replay}")
            if a.log_tail:
                lines += [f"      | {line}" for line in a.log_tail.splitlines()[-8:]]
        return "\n".join(lines)


    def snapshot_lines(self) -> list[str]:
        """SNAPSHOT_IS_IMMUTABLE: what was taken, read again, held, stalled and split."""
        c = self.snapshots
        return [
            f"  snapshots taken      {c['taken_gated'] + c['taken_spark'] + c['taken_split']} "
            f"(gated {c['taken_gated']}, spark path {c['taken_spark']}, split-read references "
            f"{c['taken_split']}; {c['rows_taken']} rows), refused: "
            f"{_by_code(c, 'take_refused_')}",
            f"  re-reads             {c['rereads']}: identical {c['reread_identical']}, "
            f"CHANGED {c['reread_changed']}, refused: {_by_code(c, 'reread_refused_')} "
            f"({c['rows_reread']} rows; none begun, gate: {_by_code(c, 'reread_gate_')})",
            f"  held transactions    begun {c['held_begun']}, ended {c['held_ended']}, ended "
            f"by a TransServer restart {c['held_ended_by_server']} (other open snapshots "
            f"{c['ended_by_server']})",
            f"  stalled writes       {c['stalls']}: parked {c['stall_parked']} (in a replay "
            f"{c['stall_in_replay']}), not reached {c['stall_not_reached']}",
            f"  split reads          {c['split_reads']} (across a GC commit "
            f"{c['split_gc']}: rewrites of a fetched file committed {c['split_gc_committed']};"
            f" across a restart {c['split_kill']}): identical {c['split_identical']}, "
            f"CHANGED {c['split_changed']}, DUPLICATES {c['split_duplicates']}, refused: "
            f"{_by_code(c, 'split_refused_')}",
        ]

    def history_lines(self) -> list[str]:
        """AS OF reads and pins."""
        h = self.history
        answered_age = _ratio(h["as_of_answered_age_s"], h["as_of_answered"])
        expired_age = _ratio(h["as_of_refused_expired_age_s"], h["as_of_refused_expired"])
        return [
            f"  AS OF reads          {h['as_of_reads']} (by ts {h['as_of_by_ts']}, by time "
            f"{h['as_of_by_time']}, through a pin {h['as_of_by_pin']}): answered "
            f"{h['as_of_answered']} (identical {h['as_of_identical']}, CHANGED "
            f"{h['as_of_changed']}; {h['as_of_rows']} rows; mean age {answered_age}s), "
            f"refused expired {h['as_of_refused_expired']} (by a node "
            f"{h['as_of_refused_expired_by_node']}, of them pinned in history a recovery "
            f"rebuilt {h['as_of_refused_pinned_rebuilt']}; mean age {expired_age}s), "
            f"time unmapped {h['as_of_refused_unmapped']}, WRONGLY "
            f"{h['as_of_refused_wrongly']}, point MOVED {h['as_of_point_moved']}; gate: "
            f"{_by_code(h, 'as_of_gate_')}; away: {_by_code(h, 'as_of_away_')}",
            f"  pins                 created {h['pins_created']}, read {h['pins_read']}, "
            f"dropped {h['pins_dropped']}; refused: create {_by_code(h, 'pin_create_refused_')}"
            f", drop {_by_code(h, 'pin_drop_refused_')}",
            *(f"  lookups {where:13s}{self.lookup_text(prefix)}" for where, prefix in
              (("once healed", ""), ("AS OF", "as_of_"), ("node away", "fault_down_"),
               ("in a fault", "fault_up_"))),
            self.feed_text(),
        ]

    def feed_text(self) -> str:
        f = self.feed
        kinds = ", ".join(f"{k} {f['changes_' + k]}" for k in
                          ("insert", "update_before", "update_after", "delete"))
        return (f"  change feed          {f['reads']} reads, {f['commits']} commits, "
                f"{f['changes']} changes ({kinds}), {f['tables_checked']} tables checked, "
                f"{f['rereads']} ranges read again: LOST {f['lost']}, DUPLICATED "
                f"{f['duplicated']}, WRONG BEFORE {f['wrong_before']}, OUT OF ORDER "
                f"{f['out_of_order']}, REREAD DIFFERS {f['reread_differs']}, EXPIRED "
                f"{f['expired']}; started again with a snapshot (rebuilt history refused) "
                f"{f['restarted_rebuilt']}; refused: {_by_code(f, 'refused_')}")

    def lookup_text(self, prefix: str) -> str:
        c = self.lookups
        return (f"{c[prefix + 'keys']} keys in {c[prefix + 'lookups']} lookups (present "
                f"{c[prefix + 'keys_present']}, deleted {c[prefix + 'keys_deleted']}, never "
                f"written {c[prefix + 'keys_never']}): answered {c[prefix + 'answered']} "
                f"({c[prefix + 'found']} keys found), WRONG {c[prefix + 'wrong']} keys, "
                f"refused: {_by_code(c, prefix + 'refused_')}")

    def gc_text(self) -> str:
        g = self.gc
        refused = ", ".join(f"{k[len('refused_'):]} {v}" for k, v in sorted(g.items())
                            if k.startswith("refused_")) or "none"
        return (f"{g['passes']} passes, {g['groups']} groups: {g['committed']} committed "
                f"({g['files_replaced']} files replaced, {g['rows_dropped']} rows dropped, "
                f"{g['chain_items']} chain items carried), refused: {refused}; outcome "
                f"unknown (node died mid-commit) {g['commit_unknown']}; rolled back by "
                f"recovery {g['rolled_back_recovery']}, in place {g['rolled_back_in_place']}; "
                f"promoted {g['promoted']}; racing source changes {g['racing_changes']}; "
                f"rewrite tasks killed {g['task_died']}, retried {g['task_retried']} "
                f"(committed {g['retry_committed']}, refused "
                f"{sum(v for k, v in g.items() if k.startswith('retry_refused_'))}); streams "
                f"left alone (a file without a place) {g['streams_skipped']}")

    def app_text(self) -> str:
        a = self.app
        exits = _by_code(a, "exit_")
        return (f"{a['sent']} transactions ({a['rows_upserted']} upserts, {a['rows_deleted']} "
                f"deletes): {a['acknowledged']} acknowledged, {a['not_sent']} not sent, in "
                f"doubt {a['in_doubt_killed']} killed + {a['in_doubt_error']} failed "
                f"({a['in_doubt_resolved']} resolved by a later open), unknown {a['unknown']}; "
                f"{a['starts']} starts, {a['opens']} opens, exits {exits}; node kills "
                f"{a['node_kills']}, {a['node_kills_with_rows_to_replay']} with acknowledged "
                f"rows above the checkpoint ({a['rows_to_replay']} rows); connector replays "
                f"{a['cdc_replays']}, {a['cdc_replays_with_writer']} naming the writer; "
                f"{a['rows_compared']} rows compared, {a['undecided_keys']} keys in doubt "
                f"at a comparison ({a['undecided_applied']} holding the in-doubt value)")

    def replay_text(self) -> str:
        r = self.replay
        return (f"{r['recoveries']} recoveries by the job ({r['marked_ready']} marked READY), "
                f"{r['task_attempts']} task attempts: {r['tasks_killed']} killed (after "
                f"{r['requests_before_kill']} acknowledged requests in all), "
                f"{r['tasks_retried']} retried, {r['retries_acknowledged']} retries "
                f"acknowledged in full; {r['requests']} requests, {r['rows']} rows sent by "
                f"finished attempts")


def _by_code(counts: Counter[str], prefix: str) -> str:
    return ", ".join(f"{k[len(prefix):]} {v}" for k, v in sorted(counts.items())
                     if k.startswith(prefix)) or "none"


def _ratio(total: int, count: int) -> str:
    return f"{total / count:.0f}" if count else "-"


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 3) if values else 0.0
