"""Prove the property tests bite: plant each known bug in a scratch copy, expect a failure.

Usage: .venv/bin/python scripts/mutants.py [--check] [--shrink] [NAME ...]
Prints, per mutant, whether each of its tests caught it, how long that took, and the shortest
counterexample printed. `--check` only verifies that every mutant still applies: its old text
occurs exactly once in its file (the run checks that first too, and stops naming any that does
not). The tests search with their default budget but do not shrink what they find (profile
`catch`, tests/conftest.py), which can take minutes and changes nothing about whether a mutant
is caught; `--shrink` shrinks (profile `default`), HYPOTHESIS_PROFILE=long digs deeper.
Nothing in the working tree is changed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MACHINE = (
    "tests/test_properties.py::"
    "test_transitions_keep_order_under_duplicates_reordering_and_crashes[redis]"
)
# The same machine over programs made mostly of maps, sleeps and waits.
NEWER = (
    "tests/test_properties.py::"
    "test_maps_sleeps_and_waits_keep_order_under_duplicates_reordering_and_crashes"
)
# The model of the scripts beside the real Lua: a Lua mutant must make them disagree.
DIFFERENTIAL = (
    "tests/test_store_model.py::test_the_model_and_the_lua_give_the_same_verdicts_and_state"
)

# Deterministic beside the two above, which reach these only now and then.
REDRIVE_KEYS = (
    "tests/test_store_model.py::"
    "test_a_redrive_takes_out_the_keys_of_the_steps_it_reruns_and_keeps_the_rest"
)
OPENS = "tests/test_machine.py::test_a_bag_opens_its_branches_and_a_branch_ends_by_joining_its_bag"
REPLAY_BAG = (
    "tests/test_owner_steps.py::"
    "test_a_replayed_advance_into_a_bag_republishes_only_branches_still_at_their_start"
)
PRUNE_PAGES = "tests/test_list.py::test_the_index_is_pruned_a_page_at_a_time_within_its_scan"
PRUNE_RESUMES = "tests/test_list.py::test_live_programs_at_the_old_end_do_not_stop_the_prune"
AGAIN = (
    "tests/test_worker_reports.py::"
    "test_a_member_of_a_complete_step_reports_it_again_only_when_redelivered"
)

FORGED_DEADLINE = "tests/test_hostile.py::test_a_forged_deadline_ends_no_program_before_its_own"
SECOND_REDRIVE = (
    "tests/test_redrive_e2e.py::test_a_second_redrive_before_the_rerun_step_moved_on_keeps_its_prev"
)
CONSUMING = "tests/test_consuming.py::"
PURGED_TIMERS = (
    "tests/test_owner_steps.py::"
    "test_timers_of_a_purged_program_whose_plan_is_cached_are_gone_once_each"
)
ROTATED = (
    "tests/test_access.py::"
    "test_healthz_says_why_rabbitmq_is_not_connected_after_a_password_rotation"
)
CLOSED = "tests/test_health.py::test_a_closed_rabbitmq_connection_is_a_fault_until_it_is_back"
CLUSTER_LOGIN = "tests/test_access.py::test_a_redis_clusters_refused_login_is_exit_2_too"
MISHANDLED = (
    "tests/test_handler_faults.py::"
    "test_a_handler_raising_what_asyncio_mishandles_fails_and_retries_its_task"
)
UNCARRIED = (
    "tests/test_handler_faults.py::"
    "test_an_output_or_error_no_message_can_carry_fails_its_task_once_per_attempt"
)
TRACEBACK = (
    "tests/test_handler_faults.py::"
    "test_a_failed_handler_logs_its_traceback_and_a_groups_error_names_its_members"
)
RETRY_GONE = "tests/test_retention.py::test_a_retry_that_outlives_its_program_is_no_dead_letter"
BUNDLE_WORKER = (
    "tests/test_bundling.py::test_a_worker_settles_each_task_of_a_bundle_as_if_it_came_alone"
)
BUNDLE_OWNER = (
    "tests/test_bundling.py::"
    "test_the_owner_bundles_only_single_tasks_without_a_limit_while_the_pool_is_busy"
)
BUNDLE_SLOTS = (
    "tests/test_bundling.py::"
    "test_a_bundle_runs_at_most_the_workers_concurrency_of_its_tasks_at_once"
)
BUNDLE_AGAIN = (
    "tests/test_bundling.py::"
    "test_a_bundle_that_came_back_sends_each_task_on_alone_counted_as_redelivered"
)
BUNDLE_SIZE = "tests/test_bundling.py::test_a_bundle_over_its_size_is_parked_whole_with_why"
BUNDLE_POOL_ONLY = "tests/test_backlog.py::test_a_bundle_follows_the_pools_own_backlog_only"
BUNDLE_SWITCH = (
    "tests/test_backlog.py::test_an_owner_bundles_single_tasks_only_when_its_settings_say_so"
)
BUNDLE_LARGEST = "tests/test_bundling.py::test_the_largest_bundle_an_owner_sends_decodes"
BUNDLE_QUEUE = (
    "tests/test_bundling.py::test_one_turns_tasks_for_a_queue_go_in_bundles_of_at_most_most"
)
REPORTS = "tests/test_report_bundles.py::"
REPORTS_DECODE = REPORTS + "test_a_bundle_of_reports_decodes_and_names_its_fault"
REPORTS_WORKER = (
    REPORTS + "test_a_workers_reports_of_a_bundles_tasks_may_go_together_a_lone_tasks_alone"
)
REPORTS_AGAIN = REPORTS + "test_a_bundle_of_reports_that_came_back_goes_on_report_by_report"
REPORTS_ORDER = REPORTS + "test_a_report_in_a_bundle_keeps_its_place_in_its_programs_order"
REPORTS_STOP = REPORTS + "test_a_stop_sends_on_the_reports_of_a_bundle_it_never_began"
REPORTS_PARTLY = REPORTS + "test_a_stop_sends_on_only_the_reports_of_a_bundle_it_never_began"
REPORTS_TURNS = REPORTS + "test_an_owner_works_on_at_most_its_prefetch_of_reports_at_once"
KEPT_HEADERS = (
    "tests/test_delivery.py::test_a_copy_keeps_only_our_headers_as_values_the_client_can_write_back"
)
HEADERS_SPLIT = (
    REPORTS + "test_a_bundle_sent_back_with_a_header_the_client_cannot_write_is_split_and_parked"
)
STAMPS = (
    "tests/test_amqp_decode.py::"
    "test_messages_with_properties_pamqp_cannot_read_are_parked_and_the_shard_goes_on"
)
DECODERS = "tests/test_amqp_decode.py::"
REPORTS_SEND_ON = (
    REPORTS + "test_reports_that_go_on_go_in_one_bundle_or_each_alone_when_they_no_longer_fit"
)
PLAN_BYTES = "tests/test_plans.py::test_plans_of_programs_of_their_own_stay_within_the_cache_bytes"
PARSE_BYTES = "tests/test_plans.py::test_what_a_parsed_program_holds_is_counted_at_least_in_full"
READ_BYTES = "tests/test_plans.py::test_what_a_read_value_holds_is_counted_at_least_in_full"
ENDED_PRUNE = (
    "tests/test_list.py::"
    "test_programs_whose_retention_ran_out_leave_the_index_behind_any_number_kept"
)
PURGE_INDEX = "tests/test_list.py::test_a_purge_takes_what_it_purged_out_of_the_indexes"
LIVEZ = "tests/test_health.py::test_livez_stays_green_while_redis_and_rabbitmq_are_unreachable"
PLAN_REUSED = (
    "tests/test_plans.py::test_an_id_ended_purged_and_submitted_again_runs_its_new_program"
)
PLANS_DROPPED = (
    "tests/test_plans.py::test_a_shards_consumer_that_becomes_its_owner_again_trusts_no_plan_kept"
)
NETWORK_POLICY = (
    "tests/test_helm.py::"
    "test_the_network_policy_lets_in_metrics_only_from_the_given_peers_or_anyone"
)
PURGE_COST = (
    "tests/test_purge.py::test_a_purge_runs_the_script_only_for_what_it_purges_a_page_a_round_trip"
)
LATE_MARK = (
    "tests/test_retention.py::"
    "test_a_late_mark_writes_nothing_for_a_program_gone_and_expires_with_an_ended_one"
)
INDEX_AGAIN = (
    "tests/test_list.py::"
    "test_an_id_submitted_again_after_its_program_went_is_listed_at_its_new_time"
)
PRUNE_KEEPS_AGAIN = (
    "tests/test_list.py::test_the_ended_prune_keeps_the_entry_of_an_id_being_submitted_again"
)
PURGE_KEEPS_AGAIN = (
    "tests/test_list.py::test_a_purge_forgets_the_entries_it_saw_not_those_of_an_id_submitted_again"
)
TIMER_HOPS = (
    "tests/test_hostile.py::"
    "test_a_long_timer_waits_in_hops_so_an_ended_program_leaves_one_hop_behind"
)
LOOPWATCH = "tests/test_loopwatch.py::test_a_blocked_loop_is_logged_with_its_stack_once_and_its_end"
LIVEZ_BLOCKED = "tests/test_health.py::test_a_blocked_event_loop_is_reported_while_it_is_blocked"
PROBED_PATHS = (
    "tests/test_helm.py::"
    "test_every_process_serves_metrics_and_health_on_one_port_and_is_probed_there"
)
ROUTER_PLANS = (
    "tests/test_plans.py::test_a_router_keeps_plans_within_its_bytes_and_never_keeps_a_missing_one"
)
PROBE = "tests/test_backlog.py::test_sampling_a_queue_opens_no_channel_per_sample"
REDRIVEN_START = (
    "tests/test_owner_steps.py::test_a_redelivered_start_of_a_redriven_run_republishes_its_step"
)
REDRIVEN_START_LUA = (
    "tests/test_owner_steps.py::test_the_lua_replays_a_redelivered_start_of_a_redriven_run"
)
REPORTS_APPLIED = REPORTS + "test_an_owner_applies_each_report_of_a_bundle_alone_and_acks_it_once"
SLEEP = "tests/test_sleep_e2e.py::test_a_sleep_waits_and_passes_its_prev_on"
SIGNALS = (
    "tests/test_signal_e2e.py::test_signals_sent_early_are_kept_and_each_is_taken_once_in_order"
)
WAKE = "tests/test_owner_steps.py::test_a_redelivered_wake_republishes_the_step_a_crash_cut_short"
REFS_STEPS = (
    "tests/test_refs.py::test_a_stale_report_of_an_old_iteration_changes_no_recorded_output[redis]"
)
INTERVAL = (
    "tests/test_sleep_e2e.py::"
    "test_a_loop_waits_its_interval_between_iterations_and_keeps_no_old_waits"
)
# The same machine over programs made mostly of bags of parallel branches.
BRANCHES = (
    "tests/test_properties.py::test_branches_keep_order_under_duplicates_reordering_and_crashes"
)
# The model beside the Lua, call by call, over forged completions of branch members and a
# branch whose bag was left.
FENCES = (
    "tests/test_store_model.py::"
    "test_a_branch_member_is_never_completed_and_a_branch_moves_only_inside_its_bag"
)
# The model beside the Lua, call by call: a branch's leaf after its bag was left (take,
# complete, fail), and the signal that stays for the later step.
LEFT = (
    "tests/test_store_model.py::"
    "test_a_branch_leaf_whose_bag_was_left_takes_records_and_fails_nothing"
)

# The model beside the Lua, call by call, through a saga's moves, a cancel's and their fences.
SAGA_STORE = "tests/test_store_model.py::test_a_saga_moves_only_while_compensating_in_its_own_scope"
# The owner's saga over the model, driven by hand: members that started before a cancel.
SAGA_LATE = (
    "tests/test_saga.py::test_started_members_end_before_the_compensations_and_are_undone_too"
)
# A real cluster: a task running when its program is cancelled ends and is undone.
CANCEL_MID_TASK = (
    "tests/test_saga_e2e.py::test_a_task_running_when_its_program_is_cancelled_ends_and_is_undone"
)
# The same machine over programs that fail often and name compensations on most tasks.
SAGAS = "tests/test_properties.py::test_sagas_keep_order_under_duplicates_reordering_and_crashes"
# The owner's saga over the model: a compensation out of tries ends compensation_failed.
SAGA_FAILED = "tests/test_saga.py::test_a_compensation_out_of_tries_ends_compensation_failed"
# A shard owner's messages side by side: each program's in delivery order.
IN_ORDER = "tests/test_program_order.py::test_each_program_in_order_others_side_by_side"
# A real owner holding 8 messages: programs overlap, one program never does; a stop begins
# nothing it holds.
WINDOW = "tests/test_owner_window.py::test_programs_overlap_and_each_keeps_its_order"
WINDOW_STOP = "tests/test_owner_window.py::test_a_stop_begins_none_of_the_messages_it_holds"
CANCEL_IN_ORDER = (
    "tests/test_program_order.py::"
    "test_a_message_cancelled_while_it_waits_never_runs_and_keeps_the_order"
)
# A single task's output carried to its owner (messages.CARRY), step by step over the model.
CARRY_OWNER = (
    "tests/test_carry.py::test_the_owner_records_a_carried_output_with_the_advance_that_used_it"
)
CARRY_WORKER = (
    "tests/test_carry.py::test_a_worker_carries_the_output_only_when_the_owner_records_it"
)
CARRY_KINDS = (
    "tests/test_carry.py::"
    "test_bag_members_undoable_tasks_and_large_outputs_are_recorded_by_the_worker"
)
# The owner's plan cache: one parse per program, however many plans record it.
PLANS_SHARE = "tests/test_plans.py::test_plans_of_one_program_share_its_parse_and_keep_their_inputs"
PLANS_SAME = (
    "tests/test_plans.py::test_a_program_is_its_recorded_text_and_its_args_keep_their_order"
)
PLANS_BOUND = "tests/test_plans.py::test_distinct_programs_kept_parsed_are_bounded"
PLANS_BYTES = "tests/test_plans.py::test_both_caches_hold_a_bounded_number_of_bytes"
STATUS_ONCE = "tests/test_plans.py::test_status_parses_a_recorded_program_once"
ROUTER_ONCE = "tests/test_plans.py::test_a_router_validates_a_program_given_again_once_and_exactly"
# The owner's sweep, bounded per pass and going on where it stopped.
BRANCH_REPLAY = "tests/test_lua.py::test_a_branch_advance_again_is_a_replay_by_the_branch_own_from"
STEP_TIMES = "tests/test_lua.py::test_an_applied_advance_times_the_step_it_leaves_on_redis_clock"
# A second report of one attempt with another error: the first one's text is kept.
FIRST_ERROR = (
    "tests/test_lua.py::test_a_failed_attempt_is_recorded_once_and_the_last_returns_every_error"
)
STEP_METRICS = "tests/test_metrics.py::test_a_running_cluster_exports_what_it_did_over_http"
SWEEP_BOUND = (
    "tests/test_sweep.py::test_each_sweep_reads_a_bounded_share_and_the_whole_set_is_still_swept"
)
# Adaptive chunks: the owner's shard queues count as a backlog, a few of them at most.
BACKLOG_UPSTREAM = "tests/test_backlog.py::test_programs_waiting_for_their_owner_go_out_in_chunks"
BACKLOG_PURE = "tests/test_backlog.py::test_messages_waiting_for_the_owner_count_as_a_backlog"

# Deterministic beside SAGAS, whose drawn programs undo two steps only now and then.
LAST_FIRST = (
    "tests/test_saga.py::test_a_failure_undoes_the_completed_steps_last_first_a_bags_side_by_side"
)
FORGED = (
    "tests/test_hostile.py::"
    "test_forged_messages_a_probe_found_looping_are_refused_on_their_first_delivery"
)
NOT_JSON = (
    "tests/test_wire_format.py::test_a_shard_message_holding_what_json_cannot_carry_is_refused"
)
ONCE = (
    "tests/test_wire_format.py::test_only_a_body_that_may_hold_an_infinite_number_is_parsed_twice"
)
DEEP = (
    "tests/test_wire_format.py::"
    "test_a_users_value_as_deep_as_the_ingress_takes_passes_in_messages_with_big_numbers"
)
DEEP_RUN = (
    "tests/test_hostile.py::"
    "test_an_input_as_deep_as_the_ingress_takes_with_a_big_number_runs_to_its_end"
)

STALLED_START = (
    "tests/test_owner_steps.py::"
    "test_a_start_that_stalled_before_its_advance_leaves_a_redriven_run_alone"
)
STALLED_START_LUA = (
    "tests/test_owner_steps.py::test_the_lua_leaves_a_redriven_run_alone_for_a_stalled_start"
)
STALLED_TAKE = (
    "tests/test_owner_steps.py::"
    "test_a_signal_handler_that_stalled_takes_nothing_from_a_redriven_run"
)
STALLED_TAKE_LUA = (
    "tests/test_owner_steps.py::"
    "test_the_lua_takes_no_signal_for_a_stalled_handler_of_an_earlier_run"
)

LANE_DROP = (
    "tests/test_pools.py::"
    "test_a_lane_task_stops_when_its_workers_connection_drops_so_two_never_overlap"
)
CONSUMER_TIMEOUT = (
    "tests/test_consumer_timeout.py::"
    "test_a_task_held_past_consumer_timeout_is_named_and_a_lane_never_runs_two"
)
LEASE_RUNS_OUT = (
    "tests/test_limits.py::test_a_slot_no_renewal_reached_is_lost_when_its_lease_runs_out"
)

LATE_UNTRACK = (
    "tests/test_owner_steps.py::test_a_late_untrack_leaves_a_program_redriven_meanwhile_counted"
)
LATE_UNTRACK_LUA = (
    "tests/test_owner_steps.py::test_redis_counts_again_a_program_redriven_before_a_late_untrack"
)

HOSTILE_TEXT = "tests/test_hostile_text.py::"
SHARD_REASON = HOSTILE_TEXT + "test_a_shard_messages_refusal_reason_holds_no_control_character"
PROGRAM_FAULTS = HOSTILE_TEXT + "test_a_programs_faults_hold_no_control_character"
REASON_ESCAPED = HOSTILE_TEXT + "test_any_refusal_reason_is_escaped_before_it_is_parked"
REFUSAL_LOGGED = HOSTILE_TEXT + "test_a_refusal_is_logged_on_one_line_and_parked_with_a_safe_reason"
SUBMIT_ERROR = HOSTILE_TEXT + "test_submit_wait_prints_a_failed_programs_error_escaped"
CLEAN_SEPARATORS = HOSTILE_TEXT + "test_clean_escapes_line_breaks_and_direction_changes"
EXPLAIN_QUOTED = HOSTILE_TEXT + "test_explain_quotes_what_it_escaped_once"
HUGE_ID = "tests/test_ingress.py::test_a_huge_workflow_id_is_refused_before_a_log_line_carries_it"

IDLE_HTTP = (
    "tests/test_health.py::test_idle_half_requests_hold_few_threads_and_only_until_the_timeout"
)
CANCEL_CUT = "tests/test_cancel_reason.py::test_a_reason_over_the_error_bound_is_kept_cut"
CANCEL_LOG = (
    "tests/test_cancel_reason.py::test_a_reason_with_line_breaks_and_escapes_is_logged_on_one_line"
)
REDRIVE_OFF_RING = (
    "tests/test_redrive_e2e.py::"
    "test_a_program_of_a_shard_that_left_the_ring_is_not_redriven_without_its_queue"
)
POOL_LABELS = (
    "tests/test_metrics.py::test_maps_over_no_items_take_no_pool_label_from_a_pool_that_runs"
)

LANE_WATCH = "tests/test_pools.py::test_a_lane_worker_keeps_no_watch_on_its_channel_after_each_task"
HTTP_TRICKLE = (
    "tests/test_health.py::test_a_client_that_trickles_its_request_is_cut_at_the_deadline"
)

HANDLER_THREADS = (
    "tests/test_handler_threads.py::"
    "test_as_many_plain_handlers_run_at_once_as_the_worker_runs_tasks"
)
LEFT_BEHIND = (
    "tests/test_handler_threads.py::"
    "test_a_handler_left_running_after_its_task_ended_is_counted_and_said"
)

LARGE_ITEMS = (
    "tests/test_saga_e2e.py::"
    "test_a_compensation_receives_an_output_over_64_kib_read_where_it_was_recorded"
)
LARGE_ITEMS_MODEL = (
    "tests/test_saga.py::test_an_output_over_64_kib_is_named_where_it_is_read_not_carried"
)
NOTICES = (
    "tests/test_cancel_notices.py::"
    "test_a_cancel_noticed_before_a_handler_starts_stops_it_and_a_redrive_runs"
)
GIVEN_BACK = (
    "tests/test_pools.py::"
    "test_a_task_given_back_to_the_worker_that_runs_it_is_not_run_a_second_time"
)
GIVEN_BACK_MODEL = "tests/test_given_back.py::"
RECORDED = (
    GIVEN_BACK_MODEL
    + "test_a_task_whose_step_is_recorded_reports_it_unrun_when_redelivered_or_retried"
)
HANDLER_FAULTS = "tests/test_handler_faults.py::"
CLOCKS = "tests/test_clocks.py::"
REQUEUE = "tests/test_cli.py::test_dead_requeue_sends_each_back_to_its_own_queue_and_keeps_the_rest"
ALARMS = "tests/test_alarms.py::test_a_memory_alarm_is_told_waits_and_loses_nothing"
FULL_REDIS = (
    "tests/test_redis_refusals.py::test_a_full_redis_parks_nothing_and_runs_no_handler_twice"
)
UNPRINTABLE = HANDLER_FAULTS + "test_an_exception_whose_text_fails_fails_its_task_once"
DEAF = HANDLER_FAULTS + "test_a_handler_that_catches_its_cancel_still_times_out_its_task"
POPS = HANDLER_FAULTS + "test_a_retry_sees_what_the_first_attempt_was_given"

DEAF_EXIT = (
    HANDLER_FAULTS + "test_a_task_that_refuses_its_cancel_does_not_hold_the_process_at_its_exit"
)

CLI_TESTS = "tests/test_cli.py::"
WRONG_SERVICES = CLI_TESTS + "test_a_service_that_answers_wrongly_or_never_is_one_line_and_exit_4"
SERVICES_DOWN = CLI_TESTS + "test_bad_settings_and_unreachable_services_are_one_line"
APP_AND_STDOUT = CLI_TESTS + "test_an_app_that_fails_at_import_and_a_full_stdout_are_one_line"
BAD_FLAGS = CLI_TESTS + "test_bad_flags_and_settings_are_refused_in_one_line_with_exit_2"

STUCK_THREAD_EXIT = (
    HANDLER_FAULTS + "test_a_plain_handler_still_running_at_the_stop_does_not_hold_the_process"
)

DEAF_CANCELLED = (
    HANDLER_FAULTS + "test_a_handler_that_catches_its_programs_cancel_gives_its_slot_back"
)

MUTANTS = {
    # A worker runs a current task whatever owner shard it names: a forged one runs its
    # handler, and again on every delivery, its report unroutable.
    "task-owner-unchecked": (
        "worker/pool.py",
        'if state.get("owner") != str(tasks[0].owner):',
        "if False:",
        (FORGED,),
    ),
    # A failed report's iteration unbounded at the door: the retry cannot be built from it.
    "failed-iteration-unbounded": (
        "orchestrator/messages.py",
        "    iteration: int = Field(default=0, ge=0, lt=MAX_ITERATIONS)\n    item: Any = None",
        "    iteration: int = 0\n    item: Any = None",
        (NOT_JSON, FORGED),
    ),
    # NaN and infinities pass the door into outputs, and reach Redis as text that is not JSON.
    "non-finite-values-pass": (
        "orchestrator/messages.py",
        "    if _may_not_be_finite(body):",
        "    if False:",
        (NOT_JSON, FORGED),
    ),
    # A number of 210 digits or more before its point, with an exponent of two digits at
    # most, passes as infinity.
    "long-floats-pass": (
        "orchestrator/messages.py",
        'if b"NaN" in body or b"Infinity" in body or _LONG_DIGITS.search(body):',
        'if b"NaN" in body or b"Infinity" in body:',
        (NOT_JSON,),
    ),
    # Only the cheap scan: every hex id holding "e851" is parsed twice.
    "exponent-scan-loose": (
        "orchestrator/messages.py",
        "return len(body) > EXACT_SCAN_BYTES or _EXPONENT.search(body) is not None",
        "return True",
        (ONCE,),
    ),
    # The number check parses as strictly as a user's document: a value as deep as the
    # ingress takes is too deep inside a message, and its program's messages are refused.
    "number-check-depth": (
        "orchestrator/messages.py",
        'check_numbers(body, "message")',
        '__import__("orchestrator.documents").documents.load(body, "message", MAX_MESSAGE_BYTES)',
        (DEEP, DEEP_RUN),
    ),
    # The lean consumer (orchestrator/consuming.py): a second ack reaches the broker (which
    # closes the channel), a closed consumer keeps what it held unread, one whose queue was
    # deleted or whose channel closed waits for ever.
    "settle-twice": (
        "orchestrator/consuming.py",
        "        if self._settled:\n",
        "        if False:\n",
        (CONSUMING + "test_a_second_settle_is_refused_here_and_the_channel_lives_on",),
    ),
    "close-keeps-unread": (
        "orchestrator/consuming.py",
        "        for message in left:",
        "        for message in ():",
        (CONSUMING + "test_closing_hands_back_what_it_holds_unread",),
    ),
    "unread-unbounded": (
        "orchestrator/consuming.py",
        "        if self._no_ack and len(self._ready) >= MAX_UNREAD_NO_ACK:",
        "        if False:",
        (CONSUMING + "test_a_consumer_without_acks_holds_at_most_its_bound_unread",),
    ),
    "broker-cancel-ignored": (
        "orchestrator/consuming.py",
        "        if frame.consumer_tag == self._tag:",
        "        if False:",
        (CONSUMING + "test_a_deleted_queue_ends_its_consumer",),
    ),
    "closed-channel-unseen": (
        "orchestrator/consuming.py",
        "        self._watch.add_done_callback(self._on_channel_closed)",
        "        pass",
        (CONSUMING + "test_a_channel_closed_under_it_fails_its_reader",),
    ),
    "bare-counter-barrier": (
        "lua/complete.lua",
        """local verdict = "again"
for k = 3, #ARGV, 2 do
  if redis.call("SADD", KEYS[2], ARGV[k]) == 1 then
    redis.call("SET", KEYS[3 + tonumber(ARGV[k])], ARGV[k + 1])
    redis.call("SADD", registry, KEYS[2], KEYS[3 + tonumber(ARGV[k])])
    verdict = "fire"
  end
  redis.call("HDEL", started, ARGV[k])  -- recorded: nothing to wait for
end
if redis.call("SCARD", KEYS[2]) < size then
  return {"wait"}
end""",
        """for k = 3, #ARGV, 2 do
  redis.call("SET", KEYS[3 + tonumber(ARGV[k])], ARGV[k + 1])
  redis.call("SADD", registry, KEYS[2], KEYS[3 + tonumber(ARGV[k])])
  redis.call("HDEL", started, ARGV[k])
end
local count = redis.call("INCRBY", KEYS[2], (#ARGV - 2) / 2)
if count < size then
  return {"wait"}
end
local verdict = "again"
if count - (#ARGV - 2) / 2 < size then
  verdict = "fire"
end""",
        (MACHINE, DIFFERENTIAL),
    ),
    "advance-without-cursor-check": (
        "lua/advance.lua",
        "if live and cursor == ARGV[1] then",
        "if live then",
        (MACHINE, DIFFERENTIAL),
    ),
    # A step's time is not read from its cursor: every step looks instant.
    "step-timed-from-now": (
        "lua/advance.lua",
        'elapsed = string.format("%d", math.max(now_ms - tonumber(since), 0))',
        'elapsed = "0"',
        (STEP_TIMES, STEP_METRICS),
    ),
    # A branch's step is timed from the program's cursor (the bag's start), not its own.
    "branch-step-timed-by-the-program": (
        "lua/advance.lua",
        "  cursor, from, since = b[1], b[2], b[3]\n  if not cursor then",
        "  cursor, from = b[1], b[2]\n  if not cursor then",
        (STEP_TIMES,),
    ),
    # A duplicate report of an attempt overwrites its error.
    "fail-overwrites-first-error": (
        "lua/fail.lua",
        'redis.call("HSETNX", KEYS[2], ARGV[2] .. ":" .. ARGV[3], ARGV[4]) == 1',
        'redis.call("HSET", KEYS[2], ARGV[2] .. ":" .. ARGV[3], ARGV[4]) == 1',
        (FIRST_ERROR, DIFFERENTIAL),
    ),
    # In Lua 0 is true: without the comparison every report of an attempt looks like its
    # first, so a duplicate report schedules the retry again.
    "every-failure-counted-as-first": (
        "lua/fail.lua",
        'local first = redis.call("HSETNX", KEYS[2], ARGV[2] .. ":" .. ARGV[3], ARGV[4]) == 1',
        'local first = redis.call("HSETNX", KEYS[2], ARGV[2] .. ":" .. ARGV[3], ARGV[4])',
        (MACHINE, DIFFERENTIAL),
    ),
    # Only a second cancel of a cancelled program is refused: a completed (or failed) program
    # is reopened as cancelled, a cancelled one failed by its deadline.
    "cancel-reopens-an-ended-program": (
        "lua/cancel.lua",
        'if status ~= "pending" and status ~= "running" then',
        "if status == ARGV[1] then",
        (MACHINE, DIFFERENTIAL),
    ),
    "complete-ignores-the-cursor": (
        "lua/complete.lua",
        'if s[1] ~= live or s[2] ~= ARGV[1] or ARGV[2] ~= (s[4] or "0") then',
        'if s[1] ~= live or ARGV[2] ~= (s[4] or "0") then',
        (MACHINE, DIFFERENTIAL),
    ),
    # Redrive: a task of the earlier run recorded in the new one (the step is the cursor
    # again, only the epoch tells them apart); a report of the earlier run moving the new
    # one on; the step that runs again keeping its first run's outputs.
    "complete-ignores-the-epoch": (
        "lua/complete.lua",
        'if s[1] ~= live or s[2] ~= ARGV[1] or ARGV[2] ~= (s[4] or "0") then',
        "if s[1] ~= live or s[2] ~= ARGV[1] then",
        (MACHINE, DIFFERENTIAL),
    ),
    "advance-ignores-the-epoch": (
        "lua/advance.lua",
        'if epoch ~= "" and epoch ~= (s[4] or "0") then',
        "if false then",
        (MACHINE, DIFFERENTIAL),
    ),
    "redrive-keeps-the-rerun-steps-keys": (
        "lua/redrive.lua",
        'if key ~= base .. "attempts" and goes(path) then',
        "if false then",
        (REDRIVE_KEYS, MACHINE, DIFFERENTIAL),
    ),
    "ack-before-publish": (
        "orchestrator/owner.py",
        "    async with process(delivery, bus, source, poison=SHARD_POISON, limit=limit):",
        "    await delivery.ack()\n"
        "    async with process(delivery, bus, source, poison=SHARD_POISON, limit=limit):",
        (MACHINE,),
    ),
    "no-republish-on-redelivery": (
        "worker/pool.py",
        'completion.verdict == "fire" or (completion.verdict == "again" and owed)',
        'completion.verdict == "fire"',
        (AGAIN, MACHINE),
    ),
    # Map steps: a list computed in the wrong scope, an empty map that never moves on, a retry
    # of one member sent as if the map were shorter.
    "map-ignores-the-loop-iteration": (
        "orchestrator/machine.py",
        "            iteration=iteration,\n            max_items=step.max_items,",
        "            iteration=0,\n            max_items=step.max_items,",
        (NEWER, MACHINE),
    ),
    "empty-map-never-moves-on": (
        "orchestrator/transitions.py",
        "            if outcome.size == 0:",
        "            if outcome.size == -1:",
        (NEWER, MACHINE),
    ),
    "map-retry-one-member-short": (
        "orchestrator/transitions.py",
        "for i in range(size))",
        "for i in range(message.index + 1))",
        (NEWER, MACHINE),
    ),
    # Sleep steps: a redelivered wake that no longer republishes what its step owed (the
    # property test found this one for real), a sleep that forgets its prev, an early wake.
    "redelivered-wake-owes-nothing": (
        "orchestrator/transitions.py",
        "        # Due, or past: a redelivered wake may owe what its step published"
        " (advance says).\n",
        '        if state.get("cursor") != message.path:\n            return "stale"\n',
        (WAKE, NEWER, MACHINE),
    ),
    "sleep-forgets-prev": (
        "orchestrator/transitions.py",
        "{leaf.path: json.dumps(leaf.prev)}",
        "{leaf.path: json.dumps(None)}",
        (NEWER, MACHINE),
    ),
    "sleep-wakes-early": (
        "orchestrator/transitions.py",
        "            if delay_ms > 0:\n                body = encode(message)",
        "            if delay_ms < 0:\n                body = encode(message)",
        (SLEEP,),
    ),
    "wait-kept-with-no-iteration": (
        "lua/advance.lua",
        'if string.sub(path .. "/", 1, #drop) == drop then',
        "if string.sub(path, 1, #drop) == drop then",
        (INTERVAL,),
    ),
    # Choice steps: a later case taken when an earlier one holds; a case's steps run under
    # another case's path.
    "choice-takes-the-last-case-that-holds": (
        "orchestrator/machine.py",
        "        if holds:\n            break",
        "        if holds and k == len(step.choice) - 1:\n            break",
        (MACHINE,),
    ),
    "choice-case-path-off": (
        "orchestrator/machine.py",
        'prefix=f"{path}/case:{k}/"',
        'prefix=f"{path}/case:0/"',
        (MACHINE,),
    ),
    # Signal steps: a replay that takes a second signal, a resend under the same id kept again.
    "take-twice": (
        "lua/take.lua",
        'if redis.call("EXISTS", KEYS[2]) == 1 then\n  return {"taken"}\nend\n',
        "",
        (MACHINE, NEWER, DIFFERENTIAL),
    ),
    "signal-ids-ignored": (
        "lua/signal.lua",
        'if ARGV[2] ~= "" and redis.call("ZSCORE", KEYS[3], ARGV[2]) then',
        "if false then",
        (MACHINE, NEWER, DIFFERENTIAL, SIGNALS),
    ),
    # Step references: a stale advance (an old iteration's report) overwrites a recorded
    # output; a loop's step keeps its first iteration's output; a retry loses the arguments
    # its args_from gave.
    "ref-recorded-before-the-cursor-check": (
        "lua/advance.lua",
        "if live and cursor == ARGV[1] then",
        'for i = 2, #KEYS do\n  redis.call("SET", KEYS[i], ARGV[i + 10])\nend\n'
        "if live and cursor == ARGV[1] then",
        (REFS_STEPS, DIFFERENTIAL, MACHINE),
    ),
    "ref-keeps-the-first-iteration": (
        "lua/advance.lua",
        'redis.call("SET", KEYS[i], ARGV[i + 10])',
        'redis.call("SET", KEYS[i], ARGV[i + 10], "NX")',
        (REFS_STEPS, DIFFERENTIAL, MACHINE),
    ),
    # Per-key limits: a run-out lease still counted (a dead worker's slot never comes back), a
    # release that frees another holder's slot (the limit exceeded), a renewal that brings
    # back a lease an acquire already dropped (its slot counted twice). Only the model beside
    # the Lua sees the release: the e2e test's holders each release once, so the count of
    # slots held stays right even when the wrong one goes.
    "acquire-ignores-expired-leases": (
        "lua/acquire.lua",
        'redis.call("ZREMRANGEBYSCORE", KEYS[1], "-inf", now)\n',
        "",
        (DIFFERENTIAL,),
    ),
    "release-frees-another-holder": (
        "lua/release.lua",
        'local removed = redis.call("ZREM", KEYS[1], ARGV[1])',
        'local removed = #redis.call("ZPOPMIN", KEYS[1]) / 2',
        (DIFFERENTIAL,),
    ),
    "renew-revives-a-dropped-lease": (
        "lua/renew.lua",
        'if not redis.call("ZSCORE", KEYS[1], ARGV[1]) then\n  return {"lost"}\nend\n'
        'redis.call("ZADD", KEYS[1], "XX", now + tonumber(ARGV[2]), ARGV[1])',
        'redis.call("ZADD", KEYS[1], now + tonumber(ARGV[2]), ARGV[1])',
        (DIFFERENTIAL,),
    ),
    # Per-key limits in the worker: it runs the handler when acquire said busy (over the
    # limit), keeps the slot when the attempt failed (leaked until its lease runs out), sends a
    # waiting task back to the pool's first share instead of the queue it came from.
    "limit-runs-when-busy": (
        "worker/pool.py",
        """        if slot.verdict == "busy":
            await self._wait_for_slot(
                task, pool, slot.held, slot.left_ms, priority, redelivered, carry
            )
            return None
""",
        "",
        (MACHINE,),
    ),
    "limit-kept-when-the-attempt-failed": (
        "worker/pool.py",
        """        try:
            return await self.run_tasks(
                [task], redelivered=redelivered, lost=lost, checked=True, carry=carry
            )
        finally:""",
        """        reports = await self.run_tasks(
            [task], redelivered=redelivered, lost=lost, checked=True, carry=carry
        )
        if any(isinstance(report, Failed) for report in reports):
            done.set()
            return reports
        try:
            return reports
        finally:""",
        (MACHINE,),
    ),
    "limit-wait-leaves-its-share": (
        "worker/pool.py",
        "task, pool, redelivered=again, priority=delivery.priority, carry=carry",
        "task, self.pool, redelivered=again, priority=delivery.priority, carry=carry",
        (MACHINE,),
    ),
    "retry-forgets-args-from": (
        "orchestrator/transitions.py",
        "leaf = replace(leaf, args=computed)",
        "leaf = replace(leaf, args=())",
        (MACHINE,),
    ),
    # Fair share: a program's tasks leave its share of the pool; a freed slot goes to the
    # consumer that asked last (a busy queue would take every slot that frees).
    "tasks-ignore-their-share": (
        "orchestrator/transitions.py",
        "pool = share_pool(pool_of(step, i if isinstance(step, Bag) else None), plan.share)",
        "pool = pool_of(step, i if isinstance(step, Bag) else None)",
        (MACHINE,),
    ),
    "slots-to-the-newest-waiter": (
        "worker/fair.py",
        "consumer = next(c for c, (_, p) in self._waiting.items() if p == top)",
        "consumer = [c for c, (_, p) in self._waiting.items() if p == top][-1]",
        ("tests/test_fair.py::test_a_freed_slot_goes_to_the_queue_that_waited_longest",),
    ),
    # Priorities: a freed slot goes to the lowest priority waiting.
    "slots-to-the-lowest-priority": (
        "worker/fair.py",
        "top = max(priority for _, priority in self._waiting.values())",
        "top = min(priority for _, priority in self._waiting.values())",
        ("tests/test_fair.py::test_a_freed_slot_goes_to_the_highest_priority_first",),
    ),
    # Parallel branches (one per new transition). A branch's move compares its own cursor
    # but answers replay by the program's `from`: a redelivery after a crash in a branch is
    # taken for stale, and what the crash cut short is never published.
    "branch-replay-by-the-program-from": (
        "lua/advance.lua",
        "  cursor, from, since = b[1], b[2], b[3]",
        "  cursor, since = b[1], b[3]",
        (BRANCH_REPLAY, BRANCHES, DIFFERENTIAL),
    ),
    # A branch's end fills its bag's barrier one member early: the bag moves on before its
    # last member finished.
    "branch-end-joins-one-early": (
        "lua/advance.lua",
        'redis.call("SCARD", barrier) >= size then',
        'redis.call("SCARD", barrier) >= size - 1 then',
        (BRANCHES, DIFFERENTIAL),
    ),
    # Opening a bag's branches forgets the branches of a branch that starts with a bag.
    "nested-branches-not-opened": (
        "orchestrator/machine.py",
        "            found.extend(first.opened())",
        "            pass",
        (OPENS, BRANCHES),
    ),
    # complete.lua takes a leaf's outermost branch for its scope, not its innermost.
    "complete-takes-the-outermost-branch": (
        "lua/complete.lua",
        'local scope = string.match(ARGV[1], "^(.*/branch:%d+)/")',
        'local scope = string.match(ARGV[1], "^(.-/branch:%d+)/")',
        (FENCES, BRANCHES, DIFFERENTIAL),
    ),
    # fail.lua compares a branch's task with the program's cursor: its failure is stale, no
    # retry is sent and the program never ends.
    "fail-ignores-the-branch-cursor": (
        "lua/fail.lua",
        "  s[2], s[3] = b[1], b[2]\nend\nif s[1] ~= live or s[2] ~= ARGV[1] or (ARGV[6]",
        "end\nif s[1] ~= live or s[2] ~= ARGV[1] or (ARGV[6]",
        (BRANCHES, DIFFERENTIAL),
    ),
    # complete.lua takes a completion for a branch member: a forged one fires the barrier
    # while the branch runs on.
    "complete-accepts-a-branch-member": (
        "lua/complete.lua",
        'if redis.call("EXISTS", base .. "cur:" .. ARGV[1] .. "/branch:" .. ARGV[k]) == 1 then',
        "if false then",
        (FENCES,),
    ),
    # A branch moves on after its bag was left (a stray `next`): its end or failure lands in
    # a step the program already passed.
    "branch-moves-outside-its-bag": (
        "lua/advance.lua",
        "  if not inside then",
        "  if false then",
        (FENCES,),
    ),
    # take.lua ignores the bag's fence: a late take in a branch whose bag was left consumes
    # the signal a later step of the same name waits for.
    "take-ignores-the-bag": (
        "lua/take.lua",
        '  if redis.call("HGET", holder, "cursor") ~= bag then  -- the bag was left',
        "  if false then",
        (LEFT,),
    ),
    # complete.lua and fail.lua alike: a late report of a branch's task whose bag was left
    # records an output, or schedules a retry, for a branch that no longer matters.
    "complete-ignores-the-bag": (
        "lua/complete.lua",
        '  if redis.call("HGET", holder, "cursor") ~= bag then  -- the bag was left: record',
        "  if false then",
        (LEFT,),
    ),
    "fail-ignores-the-bag": (
        "lua/fail.lua",
        '  if redis.call("HGET", holder, "cursor") ~= bag then  -- the bag was left: no retry',
        "  if false then",
        (LEFT,),
    ),
    # A replay of the advance into a bag republishes every branch's first leaf, also of
    # branches that moved on.
    "replay-republishes-moved-branches": (
        "orchestrator/transitions.py",
        "            moved = replay and scope_of(outcome.path)",
        "            moved = False",
        (REPLAY_BAG, BRANCHES),
    ),
    # --- saga compensation (#14 item 7) ---
    # A failure of a program that names compensations ends it failed: nothing is undone.
    "failure-skips-compensation": (
        "orchestrator/transitions.py",
        '        status = "compensating" if plan.program.compensations else "failed"',
        '        status = "failed"',
        (MACHINE,),
    ),
    # A cancel of such a program ends it cancelled (cancel.lua ignores ARGV[5]).
    "cancel-skips-compensation": (
        "lua/cancel.lua",
        'if ARGV[5] == "1" then',
        "if false then",
        (MACHINE,),
    ),
    # The plan undoes the first step first (and so, moving to lower steps, ends after it).
    "compensations-first-step-first": (
        "orchestrator/saga.py",
        "    for n, members in reversed(program.compensations):",
        "    for n, members in program.compensations:",
        (SAGAS, LAST_FIRST),
    ),
    # The saga's cursor moves whatever the status: a late start after the end runs the
    # compensations again.
    "saga-moves-after-its-end": (
        "lua/advance.lua",
        '  live = status == "compensating"',
        "  live = true",
        (SAGA_STORE, DIFFERENTIAL, SAGAS),
    ),
    # A compensation out of tries counts as done: the saga goes on and ends compensated.
    "compensation-failure-ignored": (
        "orchestrator/transitions.py",
        '                redelivered=redelivered, failure=f"compensation {failure}",',
        "                redelivered=redelivered, failure=None,",
        (SAGA_FAILED, SAGAS),
    ),
    # --- started tasks run to their end before the compensations (lua/begin.lua) ---
    # begin.lua notes nothing: a task still running at the failure reports too late, its
    # output is never recorded and what it did is never undone.
    "begin-notes-nothing": (
        "lua/begin.lua",
        '      redis.call("HSET", KEYS[2], ARGV[k], ARGV[3])',
        "      -- (nothing noted)",
        (SAGA_LATE, DIFFERENTIAL),
    ),
    # The compensations start while started tasks still run: a late output comes after the
    # plan was read, and is never undone.
    "compensations-start-while-tasks-run": (
        "orchestrator/transitions.py",
        "            if waiting:  # each one's end (a late report) sends the start again",
        "            if False:",
        (SAGA_LATE, SAGAS),
    ),
    # A late output of a single task is answered `late` but not written.
    "late-output-not-recorded": (
        "lua/complete.lua",
        '      if redis.call("SET", KEYS[2], ARGV[3], "NX") then\n        redis.call("SADD", reg',
        '      if false then\n        redis.call("SADD", reg',
        (SAGA_STORE, SAGAS),
    ),
    # A late failure is refused as stale: the member stays started and the compensations
    # wait for it for ever.
    "late-failure-refused": (
        "lua/fail.lua",
        "    and latest then",
        "    and false then",
        (SAGAS, SAGA_STORE),
    ),
    # Any failure report takes the member out, a stale one of an earlier attempt too: the
    # compensations start while its latest attempt still runs, whose output is then lost.
    "stale-failure-settles": (
        "lua/fail.lua",
        'local latest = redis.call("HGET", started, ARGV[2]) == ARGV[3]',
        'local latest = redis.call("HEXISTS", started, ARGV[2]) == 1',
        (SAGA_STORE, SAGAS),
    ),
    # A cancel stops a running task that names a compensation: it never reports, and the
    # compensations wait for it for ever.
    "cancel-stops-undoable-tasks": (
        "worker/pool.py",
        "        if is_saga(task.path) or task.undoable:",
        "        if is_saga(task.path):",
        (CANCEL_MID_TASK, SAGAS),
    ),
    # A group's members get one another's outputs (the items in reverse order).
    "compensation-items-swapped": (
        "orchestrator/transitions.py",
        "        for undo in group.undo\n    )",
        "        for undo in reversed(group.undo)\n    )",
        (SAGAS,),
    ),
    # An owner that handles a program's next message without waiting for the one before.
    "program-order-not-awaited": (
        "orchestrator/ordering.py",
        "            if before is not None:\n                await asyncio.shield(before)\n",
        "",
        (IN_ORDER,),
    ),
    # A message cancelled while it waited lets the next one of its program overtake the
    # message still running (a hard stop, a lost channel).
    "cancelled-wait-releases-the-next": (
        "orchestrator/ordering.py",
        "            if before is not None and not before.done():",
        "            if False:",
        (CANCEL_IN_ORDER,),
    ),
    # The owner runs every message at once, its program's earlier ones or not.
    "owner-ignores-program-order": (
        "orchestrator/owner.py",
        "            await (order.run(decoded.wf, begin()) if decoded else begin())",
        "            await begin()",
        (WINDOW,),
    ),
    # A stop lets the messages the owner holds begin during its grace.
    "stop-begins-held-messages": (
        "orchestrator/owner.py",
        "                    if self._stop.is_set():  # stopping: never begun, handed back "
        "now, in order\n"
        "                        await settle(message, ok=False)\n"
        "                        return\n",
        "",
        (WINDOW_STOP,),
    ),
    # A stop keeps the messages it never began until its connection closes: a standby waits.
    "stop-keeps-held-messages": (
        "orchestrator/owner.py",
        "                    await settle(message, ok=False)\n",
        "",
        (WINDOW_STOP,),
    ),
    # A sweep reads every live program each time: its cost grows with them.
    "sweep-ignores-its-budget": (
        "orchestrator/owner.py",
        "            if seen >= SWEEP_BUDGET:\n                break\n",
        "",
        (SWEEP_BOUND,),
    ),
    # Each sweep starts its scan over: programs past the first budget are never swept.
    "sweep-forgets-where-it-stopped": (
        "orchestrator/owner.py",
        '        cursor, seen = self._cursors.get(shard, "0"), 0\n',
        '        cursor, seen = "0", 0\n',
        (SWEEP_BOUND,),
    ),
    # The owner moves on from a carried output without recording it: nothing holds it.
    "carried-output-not-recorded": (
        "orchestrator/transitions.py",
        "                opened=outcome.opened(),\n                output=output,\n",
        "                opened=outcome.opened(),\n",
        (CARRY_OWNER, MACHINE),
    ),
    # A redelivered copy's report republishes from its own output, not the recorded one.
    "replay-uses-the-reports-output": (
        "orchestrator/transitions.py",
        "        if read.values is not None and read.values[0] == output:\n",
        "        if True:\n",
        (CARRY_OWNER,),
    ),
    # A worker carries the output although no owner promised to record it.
    "carry-without-the-header": (
        "worker/pool.py",
        "        carry = (delivery.headers or {}).get(CARRY) == 1\n",
        "        carry = True\n",
        (CARRY_WORKER,),
    ),
    # A task of a step that names compensations is carried: its started mark stays.
    "carry-an-undoable-task": (
        "worker/pool.py",
        "    if task.index is not None or task.undoable or is_saga(task.path):\n",
        "    if task.index is not None or is_saga(task.path):\n",
        (CARRY_KINDS, CANCEL_MID_TASK),
    ),
    # A plan-cache miss parses its program again, however many plans share it.
    "plans-parse-every-miss": (
        "orchestrator/caches.py",
        "        found = self._programs.get(key)\n",
        "        found = None\n",
        (PLANS_SHARE,),
    ),
    # Programs are told apart by their name only: two unnamed programs run each other's steps.
    "plans-share-by-name": (
        "orchestrator/caches.py",
        "            key = hashlib.blake2b(text, digest_size=32).digest()\n",
        '            key = json.dumps(source.get("name")).encode()\n',
        (PLANS_SAME, MACHINE),
    ),
    # The key is a normal form of the program: programs whose args differ only in key order
    # share one parse, and one of them runs with the other's order.
    "plans-sorted-key": (
        "orchestrator/caches.py",
        "json.dumps(source)).encode()",
        "json.dumps(source, sort_keys=True)).encode()",
        (PLANS_SAME,),
    ),
    # A program used again is not moved up: the one used most is let go first.
    "plans-not-lru": (
        "orchestrator/caches.py",
        "        self._values.move_to_end(key)\n",
        "        pass\n",
        (PLANS_BOUND,),
    ),
    # The router takes a value json writes as another's text for that one: a dict with an int
    # key passes as the program with that key as a string once that one was checked.
    "router-validates-inexactly": (
        "orchestrator/caches.py",
        "        if found is not None and (not exact or found[0] == source):\n",
        "        if found is not None:\n",
        (ROUTER_ONCE,),
    ),
    # The router checks every program it is given, however often it saw it.
    "router-validates-every-time": (
        "router/client.py",
        "        return self._validated.get(program)\n",
        "        return self._validate(program)\n",
        (ROUTER_ONCE,),
    ),
    # `status` parses the recorded program each time it is asked.
    "status-parses-every-time": (
        "router/explain.py",
        '        return _RECORDED.get(raw.get("program"))\n',
        '        return parse_program(raw.get("program"), max_bytes=1 << 30)\n',
        (STATUS_ONCE,),
    ),
    # Every distinct program stays parsed: the owner's memory grows with the programs it saw.
    "plans-unbounded": (
        "orchestrator/caches.py",
        "            len(self._values) > self._size or self.bytes > self._max_bytes\n",
        "            self.bytes > self._max_bytes\n",
        (PLANS_BOUND,),
    ),
    # The caches count entries only: 1,024 plans of large inputs outgrow the pod's memory.
    "plans-bytes-unbounded": (
        "orchestrator/caches.py",
        "            len(self._values) > self._size or self.bytes > self._max_bytes\n",
        "            len(self._values) > self._size\n",
        (PLANS_BYTES,),
    ),
    # Only the pool's own queue counts: a burst waiting for its owner goes out unchunked.
    "backlog-ignores-upstream": (
        "orchestrator/backlog.py",
        "        waiting = self.ready(pool) + sum(self._ready(queue) for queue in self._upstream)"
        "\n",
        "        waiting = self.ready(pool)\n",
        (BACKLOG_UPSTREAM, BACKLOG_PURE),
    ),
    # The index is pruned a page at a time, each page at the offset of the entries seen, as if
    # nothing had been dropped: the entries that moved up are skipped.
    "prune-pages-skip-what-moved-up": (
        "orchestrator/marks.py",
        "            start = first + seen - dropped  # what was dropped before moved the rest up\n",
        "            start = first + seen\n",
        (PRUNE_PAGES,),
    ),
    # A deadline message ends its program whenever it comes: a forged one, or one an
    # operator's message-ttl policy let out early, ends a live program before its time.
    "deadline-ignores-the-time": (
        "orchestrator/transitions.py",
        "            left_s = since_ms / 1000 + deadline_s - now\n",
        "            left_s = 0\n",
        (MACHINE, FORGED_DEADLINE),
    ),
    # The deadline a message names is trusted over its program's own.
    "deadline-trusts-the-message": (
        "orchestrator/transitions.py",
        "        deadline_s = plan.program.deadline_s\n        if deadline_s is None:\n",
        "        deadline_s = message.deadline_s\n        if deadline_s is None:\n",
        (FORGED_DEADLINE,),
    ),
    # A redriven run's start comes from nowhere: a cancel or failure at the rerun step keeps
    # no prior, and the next redrive runs that step with prev null.
    "redriven-start-forgets-its-prior": (
        "lua/advance.lua",
        '    came_from = redis.call("HGET", KEYS[1], "prior") or ""\n',
        '    came_from = ""\n',
        (DIFFERENTIAL, SECOND_REDRIVE),
    ),
    # The prune starts at the oldest entries every time: live programs there hide the rest.
    "prune-forgets-its-place": (
        "orchestrator/marks.py",
        "        first = self._prune_rank\n",
        "        first = 0\n",
        (PRUNE_RESUMES,),
    ),
    # Every shard an owner holds is sampled, however many: a sample per shard per interval.
    "backlog-samples-every-shard": (
        "orchestrator/backlog.py",
        "        self._upstream = tuple(upstream)[:MAX_UPSTREAM]\n",
        "        self._upstream = tuple(upstream)\n",
        (BACKLOG_PURE,),
    ),
    # A bundle's tasks settled together: one program's poison parks the others' tasks too.
    "bundle-parks-whole": (
        "worker/pool.py",
        "                async with process(part, self.bus, source, limit=limit):\n"
        "                    await self._run_message(task, part, source)\n",
        "                await self._run_message(task, part, source)\n",
        (BUNDLE_WORKER,),
    ),
    # A bundle acked as its tasks start, not once their reports are confirmed.
    "bundle-acks-before-its-tasks": (
        "worker/pool.py",
        "            *(run() for _ in range(side_by_side)), return_exceptions=True\n",
        "            *[self._spawn(run()) for _ in range(side_by_side)][:0],\n"
        "            return_exceptions=True,\n",
        (BUNDLE_WORKER,),
    ),
    # Tasks bundled while the pool is idle: they no longer spread over its workers.
    "bundle-when-idle": (
        "orchestrator/transitions.py",
        "        return 1 if is_lane(pool) else self.bundle_for(pool)\n",
        "        return 1 if is_lane(pool) else max(2, self.bundle_for(pool))\n",
        (BUNDLE_OWNER,),
    ),
    # A task with a limit bundled: it would share a slot with other programs' tasks.
    "bundle-takes-limited-tasks": (
        "orchestrator/transitions.py",
        "not isinstance(step, Task) or step.limit is not None:\n",
        "not isinstance(step, Task):\n",
        (BUNDLE_OWNER,),
    ),
    # A bundle over its size: one message takes more tasks than the backlog asked for.
    "bundle-uncapped": (
        "orchestrator/bundling.py",
        "        if current is None or len(current.bodies) >= most or current.size > most_bytes:\n",
        "        if current is None or current.size > most_bytes:\n",
        (BUNDLE_QUEUE,),
    ),
    # A bundle's tasks all side by side: a worker of 1 runs several handlers at once.
    "bundle-ignores-concurrency": (
        "worker/pool.py",
        "        side_by_side = min(len(tasks), self.concurrency)\n",
        "        side_by_side = len(tasks)\n",
        (BUNDLE_SLOTS,),
    ),
    # A redelivered bundle run again whole: a task that killed the worker takes the others down
    # with it every time.
    "bundle-runs-again-whole": (
        "worker/pool.py",
        "        if redelivered(delivery):\n            # A try was cut short",
        "        if False:\n            # A try was cut short",
        (BUNDLE_AGAIN,),
    ),
    # A bundle of any size up to a message's: its tasks, written again alone, may not fit.
    "bundle-of-any-size": (
        "orchestrator/messages.py",
        "    if len(body) > MAX_BUNDLE_BODY:\n",
        "    if False:\n",
        (BUNDLE_SIZE, REPORTS_DECODE),
    ),
    # Bundles follow the shard queues' backlog too: a burst of submits bundles the first steps
    # of a pool whose workers are idle.
    "bundle-follows-the-shards": (
        "orchestrator/backlog.py",
        "        return auto_chunk(self.ready(pool), self.limit)\n",
        "        return self.chunk(pool)\n",
        (BUNDLE_POOL_ONLY,),
    ),
    # SHARDFLOW_BUNDLE_TASKS=false is not heard: a rolling upgrade parks bundles.
    "bundle-ignores-its-switch": (
        "orchestrator/transitions.py",
        "        self.bundle_for = backlog.bundle if backlog and bundles else None\n",
        "        self.bundle_for = backlog.bundle if backlog else None\n",
        (BUNDLE_SWITCH,),
    ),
    # A worker's bound forgets the commas and brackets: the owner's largest bundles are parked.
    "bundle-bound-without-separators": (
        "orchestrator/messages.py",
        "MAX_BUNDLE_BODY = MAX_BUNDLE_BYTES + MAX_BUNDLE + 1\n",
        "MAX_BUNDLE_BODY = MAX_BUNDLE_BYTES\n",
        (BUNDLE_LARGEST,),
    ),
    # Bundles keyed by queue alone: an urgent task waits in a bundle at the lower priority.
    "bundle-mixes-priorities": (
        "orchestrator/bus.py",
        "            key = (pool, priority, tuple(sorted(headers.items())) if headers else ())\n",
        "            key = (pool, GOING_ON, tuple(sorted(headers.items())) if headers else ())\n",
        (BUNDLE_QUEUE,),
    ),
    # A bundle of reports may carry any shard message: a start or a deadline rides in one.
    "report-bundle-of-any-message": (
        "orchestrator/messages.py",
        "_REPORTS = TypeAdapter(Annotated[list[Report], ",
        "_REPORTS = TypeAdapter(Annotated[list[ShardMessage], ",
        (REPORTS_DECODE,),
    ),
    # Every report is offered to a bundle: a lone task's report waits a turn for nothing.
    "reports-of-a-lone-task-bundled": (
        "worker/pool.py",
        "        most = MAX_BUNDLE if isinstance(delivery, Part) else 1\n",
        "        most = MAX_BUNDLE\n",
        (REPORTS_WORKER,),
    ),
    # A bundle of reports that came back applied whole again: one report that kills the owner
    # takes the others down with it every time.
    "report-bundle-applied-again-whole": (
        "orchestrator/owner.py",
        "            elif redelivered(message):\n",
        "            elif False:\n",
        (REPORTS_AGAIN,),
    ),
    # A bundle's reports started after the next message's work: a report and its program's
    # next message swap places.
    "report-bundle-spawned-late": (
        "orchestrator/owner.py",
        "runs = [self._spawn(handle(p, r)) for p, r in",
        "runs = [(handle(p, r)) for p, r in",
        (REPORTS_ORDER,),
    ),
    # A bundle acked though a report was handed back at a stop: that report is lost.
    "report-bundle-acked-though-handed-back": (
        "orchestrator/owner.py",
        "            if isinstance(outcome, BaseException) or part.handed_back:\n",
        "            if isinstance(outcome, BaseException):\n",
        (REPORTS_STOP, REPORTS_PARTLY),
    ),
    # A bundle partly applied at a stop handed back whole: when it comes back and is split,
    # each report already applied publishes its program's next task again.
    "report-bundle-handed-back-whole-at-a-stop": (
        "orchestrator/owner.py",
        "        async with process(whole, self.bus, queue, limit=self.limit):\n",
        "        await settle(whole, ok=False)\n        if False:\n",
        (REPORTS_PARTLY,),
    ),
    # A bundle's reports each start a transition at once: a bundle of 100 runs 100 beside
    # the prefetch's, and a broken Redis is tried 100 times a pause.
    "report-bundle-unbounded": (
        "orchestrator/owner.py",
        "                async with turns:\n",
        "                async with asyncio.Semaphore(1000):\n",
        (REPORTS_TURNS,),
    ),
    # A message sent again after a failure keeps every header: one the client cannot write
    # back fails each try to send it again, and it goes round forever.
    "requeue-keeps-every-header": (
        "orchestrator/delivery.py",
        "        headers = kept_headers(delivery.headers)\n",
        "        headers = dict(delivery.headers or {})\n",
        (KEPT_HEADERS,),
    ),
    # A bundle's split keeps every header, with the same end.
    "split-keeps-every-header": (
        "orchestrator/delivery.py",
        "    return {FAILURES: 0, **kept_headers(delivery.headers)}\n",
        "    return {FAILURES: 0, **(delivery.headers or {})}\n",
        (KEPT_HEADERS,),
    ),
    # Both: every header kept, whatever its value (each path alone is masked by the other's
    # fix on a real broker: a failed split is sent again whole with our headers only).
    "kept-headers-keeps-all": (
        "orchestrator/delivery.py",
        "    return kept\n",
        "    return dict(headers or {})\n",
        (KEPT_HEADERS, HEADERS_SPLIT),
    ),
    # pamqp's own timestamp decoder: a timestamp no datetime holds drops the connection on
    # every delivery, and the shard is wedged.
    "amqp-decode-not-installed": (
        "orchestrator/bus.py",
        "amqp_decode.install()  # before any frame is read",
        "amqp_decode.PAMQP_TIMESTAMP  # before any frame is read",
        (STAMPS,),
    ),
    # pamqp's strict short strings: a routing key or message id that is no UTF-8 drops the
    # connection (a properties one is caught by the content header's guard too).
    "short-strings-strict": (
        "orchestrator/amqp_decode.py",
        '    decode.METHODS["shortstr"] = short_str',
        "    pass",
        (DECODERS + "test_a_short_string_that_is_no_utf8_reads_with_replacements",),
    ),
    # pamqp's strict content header: a header name that is no UTF-8 drops the connection.
    "content-header-strict": (
        "orchestrator/amqp_decode.py",
        "    ContentHeader.unmarshal = content_header",
        "    pass",
        (STAMPS, DECODERS + "test_properties_pamqp_cannot_read_leave_a_delivery_with_none"),
    ),
    # Headers nested deeper than pamqp recurses: the guard misses its RecursionError.
    "content-header-recursion-uncaught": (
        "orchestrator/amqp_decode.py",
        "    except (ValueError, OverflowError, OSError, RecursionError):",
        "    except (ValueError, OverflowError, OSError):",
        (DECODERS + "test_properties_pamqp_cannot_read_leave_a_delivery_with_none",),
    ),
    # Reports that go on always in one bundle: one written again longer than an owner reads
    # is parked whole, valid reports with it.
    "send-on-over-the-bound": (
        "orchestrator/owner.py",
        "    if len(body) > MAX_BUNDLE_BODY:\n        await split(",
        "    if False:\n        await split(",
        (REPORTS_SEND_ON,),
    ),
    # A redriven run's redelivered start is stale (it came from `prior`, not ""): a crash
    # between its advance and its publish loses the run (the property test found it).
    "redriven-start-never-replays": (
        "lua/advance.lua",
        'if ARGV[1] == "" and scope == "" and cursor ~= "" and cursor == ARGV[2]\n',
        'if false and ARGV[1] == "" and scope == "" and cursor ~= "" and cursor == ARGV[2]\n',
        (REDRIVEN_START_LUA,),
    ),
    "redriven-start-never-replays-in-the-model": (
        "orchestrator/memory_store.py",
        "        again = bool(not expected and not scope and now_cursor and now_cursor == cursor)",
        "        again = False",
        (REDRIVEN_START,),
    ),
    # A start rides in a bundle of reports, which an owner parks whole with the others.
    "report-bundle-carries-a-start": (
        "worker/pool.py",
        "1 if isinstance(report, Start) else most",
        "most",
        (REPORTS_WORKER,),
    ),
    # One report's fault parks the whole bundle's body: the others would run again if redriven.
    "report-bundle-part-parks-the-whole": (
        "orchestrator/owner.py",
        "parts = [Part(message, functools.partial(encode, report)) for",
        "parts = [Part(message, lambda: message.body) for",
        (REPORTS_APPLIED,),
    ),
    # The queue probe on aio-pika's robust channel: one the broker closed (a missing queue's
    # 404) reopens itself behind the close, and every sample of it leaves a channel open.
    "probe-on-a-robust-channel": (
        "orchestrator/bus.py",
        "self._probe = probe = await self._raw_channel()",
        "self._probe = probe = await _underlay(await self._consumer_channel())",
        (PROBE,),
    ),
    # The plan cache counts inputs only: plans of programs of their own hold their parses
    # uncounted, 1.5 GB at the default 16,384.
    "plan-cache-ignores-programs": (
        "orchestrator/plans.py",
        "    return entry[0].program, entry[0].program_bytes\n",
        "    return entry[0].program, 0\n",
        (PLAN_BYTES,),
    ),
    # A program's models counted as plain JSON: a chain of tasks holds more than it says.
    "program-bytes-without-models": (
        "orchestrator/caches.py",
        '    return PROGRAM_BYTES + json_bytes(text) + MODEL_BYTES * text.count(b"{")',
        "    return json_bytes(text)",
        (PARSE_BYTES,),
    ),
    # The sweep only scans the creation index: past 167 programs a second per process the
    # index grows for good.
    "sweep-skips-the-ended-prune": (
        "orchestrator/owner.py",
        "        await self.marks.prune_ended()\n",
        "",
        (ENDED_PRUNE,),
    ),
    # An end is not noted: nothing is ever due in the ended index.
    "untrack-notes-no-end": (
        "orchestrator/redis_store.py",
        "            pipe.zadd(self.keys.index_ended, {wf: time.time() * 1000})\n",
        "",
        (ENDED_PRUNE, PURGE_INDEX),
    ),
    # A program whose keys are still there when its note falls due (redriven since, a lower
    # retention elsewhere) keeps its old note: looked at again at every sweep, never dropped.
    "ended-note-not-moved-on": (
        "orchestrator/marks.py",
        "            if again:  # XX: one a purge took out meanwhile is not put back\n",
        "            if False:\n",
        (ENDED_PRUNE,),
    ),
    # A 404 counted without a bound: 2 ** 1024 is no float, and the service crashed after
    # 4.5 hours of a node down.
    "refused-count-unbounded": (
        "orchestrator/lifecycle.py",
        "refused = min(refused + 1, 16) if",
        "refused = refused + 1 if",
        (
            "tests/test_lifecycle.py::"
            "test_a_queue_that_refuses_each_start_is_tried_again_later_and_later",
        ),
    ),
    # A purge leaves its programs in the indexes, for a scan that may never reach them.
    "purge-leaves-the-index": (
        "router/retention.py",
        "    await marks.forget(purged)\n    await marks.prune_index()\n",
        "    await marks.prune_index()\n",
        (PURGE_INDEX,),
    ),
    # /livez asks the dependencies too: an outage of Redis or RabbitMQ restarts every pod.
    "livez-checks-dependencies": (
        "orchestrator/health.py",
        '"/livez": health.not_live',
        '"/livez": health.faults',
        (LIVEZ,),
    ),
    # A start takes its plan from the cache: an id ended, purged and submitted again ran the
    # program it had before.
    "plan-cached-at-start": (
        "orchestrator/transitions.py",
        "self.plans.get(message.wf, fresh=isinstance(message, Start))",
        "self.plans.get(message.wf)",
        (PLAN_REUSED,),
    ),
    # A shard's consumer that starts again keeps the plans from before it was away.
    "plans-kept-across-consumers": (
        "orchestrator/owner.py",
        "                self.transitions.plans.forget_shard(shard)\n",
        "",
        (PLANS_DROPPED,),
    ),
    # A plan read before its shard's plans were forgotten is still a hit.
    "plans-generation-unchecked": (
        "orchestrator/plans.py",
        "return plan if generation == self._generations.get(plan.owner, 0) else None",
        "return plan",
        (PLANS_DROPPED,),
    ),
    # A redrive a purge overtook leaves its program counted live.
    "redrive-purged-stays-live": (
        "router/client.py",
        'if found.status in TERMINAL or found.verdict == "missing":',
        "if found.status in TERMINAL:",
        (
            "tests/test_redrive_e2e.py::"
            "test_a_redrive_that_a_purge_overtakes_leaves_nothing_counted_live",
        ),
    ),
    # The NetworkPolicy admits nothing (as it did without the ServiceMonitor): its one rule
    # moved under a key that is no rule.
    "metrics-port-closed": (
        "helm/shardflow/templates/networkpolicy.yaml",
        "  ingress:\n    - ports:\n",
        "  ingress: []\n  closed:\n    - ports:\n",
        (NETWORK_POLICY,),
    ),
    # networkPolicy.metricsFrom is ignored: the metrics port is open to anyone.
    "metrics-from-ignored": (
        "helm/shardflow/templates/networkpolicy.yaml",
        "{{- with .Values.networkPolicy.metricsFrom }}",
        "{{- with .Values.networkPolicy.egress }}",
        (NETWORK_POLICY,),
    ),
    # The policy opens the default port, not metrics.port.
    "policy-port-not-metrics-port": (
        "helm/shardflow/templates/networkpolicy.yaml",
        "- port: metrics",
        "- port: 9464",
        (NETWORK_POLICY,),
    ),
    # A command that only looks declares the whole topology again.
    "looking-declares": (
        "orchestrator/bus.py",
        "        if not declare:\n            return\n",
        "",
        ("tests/test_cli.py::test_commands_that_only_look_create_no_queue",),
    ),
    # A loop late while idle in select is called blocked, at a frame that is no handler's.
    "loopwatch-idle-unseen": (
        "orchestrator/loopwatch.py",
        "        if frame is not None and _idle(frame):",
        "        if False:",
        ("tests/test_loopwatch.py::test_an_idle_loop_not_let_run_is_starved_not_blocked",),
    ),
    # A purge sends every program it meets to purge.lua, kept or not: one EVALSHA each.
    "purge-scripts-what-it-keeps": (
        "router/retention.py",
        "            verdict = purge_verdict(status, ended, wanted, cutoff_ms)\n",
        '            verdict = "purged"\n',
        (PURGE_COST,),
    ),
    # A purge reads and deletes one program a round trip.
    "purge-a-program-a-round-trip": (
        "router/retention.py",
        "PURGE_PAGE = 500\n",
        "PURGE_PAGE = 1\n",
        (PURGE_COST,),
    ),
    # A late mark writes the registry of a program gone: no expiry, never purged.
    "late-mark-writes-for-a-program-gone": (
        "lua/mark.lua",
        'if not redis.call("HGET", KEYS[1], "status") then\n  return "missing"\nend\n',
        "",
        (LATE_MARK,),
    ),
    # A mark for an ended program never expires (nor the registry it made).
    "late-mark-never-expires": (
        "lua/mark.lua",
        "if left > 0 then\n",
        "if false then\n",
        (LATE_MARK,),
    ),
    # An id submitted again keeps its gone program's creation time (ZADD NX only).
    "index-keeps-a-gone-programs-time": (
        "router/client.py",
        "            await self._marks.reindex(wf, at_ms)\n",
        "            pass\n",
        (INDEX_AGAIN,),
    ),
    # A shard's plans are forgotten when its consumer starts, not at its first delivery: a
    # standby's consumer started long before it became the owner.
    "plans-forgotten-at-start": (
        "orchestrator/owner.py",
        "            owning = False\n",
        "            owning = False\n            self.transitions.plans.forget_shard(shard)\n",
        (PLANS_DROPPED,),
    ),
    # A handler waiting in a selector (subprocess.run) reads as an idle loop.
    "loopwatch-any-select-idle": (
        "orchestrator/loopwatch.py",
        'return caller is not None and caller.f_code.co_name == "_run_once"',
        "return True",
        (
            "tests/test_loopwatch.py::"
            "test_a_handler_waiting_for_a_child_process_is_blocked_not_idle",
        ),
    ),
    # The sweep's repair only adds missing entries: one left at an earlier program's time,
    # its router failed before moving it, stays there.
    "repair-adds-only": (
        "orchestrator/marks.py",
        "await self._store.reindex(self.keys.index_created, created, INDEX_GRACE_MS)",
        "await self._store.reindex(self.keys.index_created, created, 10**15)",
        (INDEX_AGAIN,),
    ),
    # A plan read across its shard's forgetting is kept as current.
    "plan-kept-across-forget": (
        "orchestrator/plans.py",
        "        if forgets == self._forgets:",
        "        if True:",
        ("tests/test_plans.py::test_a_plan_read_while_its_shard_is_forgotten_is_not_kept",),
    ),
    # The indexes drop an id whatever its entry: one submitted again loses its new entry.
    "forget-by-id": (
        "lua/unindex.lua",
        "  if score and tonumber(score) <= tonumber(ARGV[i + 1]) then\n",
        "  if score then\n",
        (PRUNE_KEEPS_AGAIN, PURGE_KEEPS_AGAIN),
    ),
    # A timer waits its whole delay in the broker: an ended program's deadline is held a day.
    "timer-hop-uncapped": (
        "orchestrator/bus.py",
        "        delay_s = min(delay_s, MAX_TIMER_HOP_MS / 1000)\n",
        "",
        (TIMER_HOPS,),
    ),
    # The watch logs a stall at every check while it lasts: a log line every 0.25 s.
    "loopwatch-every-check": (
        "orchestrator/loopwatch.py",
        "if stalled_since is None and late > self.blocked_s:",
        "if late > self.blocked_s:",
        (LOOPWATCH,),
    ),
    # The stack logged is the watching thread's own, which names no handler.
    "loopwatch-own-stack": (
        "orchestrator/loopwatch.py",
        "sys._current_frames().get(self._loop_thread)",
        "sys._current_frames().get(threading.get_ident())",
        (LOOPWATCH,),
    ),
    # /livez always answers 200: a stuck loop is never restarted.
    "livez-always-live": (
        "orchestrator/health.py",
        '"/livez": health.not_live',
        '"/livez": list',
        (LIVEZ_BLOCKED,),
    ),
    # The chart's liveness probe stays on /healthz.
    "liveness-probe-on-healthz": (
        "helm/shardflow/templates/_helpers.tpl",
        "livenessProbe:\n        httpGet: {path: /livez,",
        "livenessProbe:\n        httpGet: {path: /healthz,",
        (PROBED_PATHS,),
    ),
    # A pod that starts, reaches both services, then meets an outage is killed at 180 s and
    # restarted into a wait that ends in exit: CrashLoopBackOff for an outage.
    "startup-probe-on-healthz": (
        "helm/shardflow/templates/_helpers.tpl",
        "startupProbe:\n        httpGet: {path: /livez,",
        "startupProbe:\n        httpGet: {path: /healthz,",
        (PROBED_PATHS,),
    ),
    # An owner's timers on its own clock: two minutes ahead, a 60 s deadline failed at once.
    "clock-unsynced": (
        "orchestrator/clock.py",
        "self._offset = server - (before + after) / 2",
        "self._offset = 0.0",
        (CLOCKS + "test_an_owner_whose_clock_is_ahead_fires_no_timer_early",),
    ),
    # A resource alarm of RabbitMQ's: every probe green, every queue still, the system idle.
    "alarm-unseen": (
        "orchestrator/bus.py",
        "return isinstance(unblocked, asyncio.Event) and not unblocked.is_set()",
        "return False",
        (ALARMS,),
    ),
    # A channel opened while blocked took a closed one's number: the broker closed all.
    "channel-opened-while-blocked": (
        "orchestrator/bus.py",
        "        if self.publishing_blocked:  # opened now",
        "        if False:  # opened now",
        (ALARMS,),
    ),
    # An ingress request parked at the limit got no answer: its sender heard nothing.
    "limit-parks-unanswered": (
        "orchestrator/delivery.py",
        "            if on_poison is not None:\n"
        "                await on_poison(reason)\n"
        "        else:",
        "        else:",
        (
            "tests/test_delivery.py::test_a_message_parked_at_the_limit_is_answered_as_a_poison_one_is",
        ),
    ),
    # A cancel whose notice an alarm held back: its program's handlers ran to their end.
    "cancels-heard-only-from-the-broker": (
        "worker/pool.py",
        '                if status == "cancelled" and wf in self._running:',
        "                if False:",
        ("tests/test_e2e.py::test_a_cancel_whose_notice_is_lost_still_stops_running_tasks",),
    ),
    # A letter parked without its sender's message id: an ingress request sent back by
    # `dead --requeue` got a new workflow id, and a program recorded before ran twice.
    "parked-without-its-id": (
        "orchestrator/bus.py",
        'headers[SENT_ID] = message_id if message_id and len(message_id) <= MAX_MESSAGE_ID else ""',
        'headers[SENT_ID] = ""',
        (REQUEUE,),
    ),
    "requeue-old-ingress-letters": (
        "router/dead_letters.py",
        "    if source == names.ingress_queue and SENT_ID not in headers:",
        "    if False:",
        (REQUEUE,),
    ),
    # A header naming a shard of thousands of digits: int() raised, and `--requeue` stopped.
    "dead-letter-numbers-unbounded": (
        "router/dead_letters.py",
        "    return 0 < len(text) <= 6 and text.isascii() and text.isdigit()",
        "    return 0 < len(text) and text.isascii() and text.isdigit()",
        (
            "tests/test_dead_letters.py::test_a_header_of_thousands_of_digits_is_no_queue_and_no_crash",
        ),
    ),
    # Kept for good (retention 0): the ended index kept a retention before's entries for good.
    "ended-prune-off-when-kept": (
        "orchestrator/marks.py",
        "        due = now_ms() - max(self._retention_ms, 0) - INDEX_GRACE_MS",
        "        if self._retention_ms <= 0:\n            return 0\n"
        "        due = now_ms() - max(self._retention_ms, 0) - INDEX_GRACE_MS",
        (
            "tests/test_list.py::test_the_ended_prune_still_walks_what_a_retention_before_left_once_kept_for_good",
        ),
    ),
    # A wait for a slot that outlived its program was parked, as a first try is.
    "late-slot-wait-parked": (
        "worker/pool.py",
        "        if first.attempt == 0 and (first.limit is None or first.limit.waits == 0):",
        "        if first.attempt == 0:",
        (
            "tests/test_hostile.py::test_a_wait_for_a_slot_that_outlived_its_program_is_dropped_a_first_try_parked",
        ),
    ),
    # A worker given a Redis of no program of the prefix dropped every retry it took.
    "gone-without-evidence": (
        "worker/pool.py",
        "        if not await self.store.shards_used():",
        "        if False:",
        (
            "tests/test_hostile.py::test_a_retry_of_no_program_is_parked_by_a_worker_whose_redis_holds_none",
        ),
    ),
    # Kept for good, an entry of a program with no expiry was read again every minute, for good.
    "ended-prune-rereads-the-kept": (
        "orchestrator/marks.py",
        "            elif unexpiring:",
        "            elif False:",
        (
            "tests/test_list.py::test_the_ended_prune_still_walks_what_a_retention_before_left_once_kept_for_good",
        ),
    ),
    # A retry that outlived its program was parked as "no such program", for good.
    "late-retry-parked": (
        "worker/pool.py",
        "        if first.attempt == 0 and (first.limit is None or first.limit.waits == 0):",
        "        if True:",
        ("tests/test_retention.py::test_a_retry_that_outlives_its_program_is_no_dead_letter",),
    ),
    # A refused login was retried as an outage for the whole startup wait, then exit 4.
    "amqp-login-retried": (
        "orchestrator/bus.py",
        "            if isinstance(exc, AUTHENTICATION):",
        "            if False:",
        (
            "tests/test_access.py::test_a_wrong_password_is_one_line_and_exit_2_at_once_for_commands_and_services",
        ),
    ),
    # A name the user may not declare: a 78-line traceback and exit 1.
    "amqp-access-traceback": (
        "orchestrator/bus.py",
        "        except aiormq.exceptions.ChannelAccessRefused as exc:",
        "        except aiormq.exceptions.ChannelNotFoundEntity as exc:",
        ("tests/test_access.py::test_a_user_who_may_not_declare_is_told_what_it_needs",),
    ),
    # A worker's control queue under aio-pika's name, outside the prefix a user may declare.
    "control-queue-unprefixed": (
        "orchestrator/bus.py",
        "                self.names.control_queue(),  # aio-pika's own name (`amq_...`) is no ours",
        "                None,",
        ("tests/test_access.py::test_the_permissions_the_readme_gives_run_a_program_end_to_end",),
    ),
    # A Redis login refused was waited for, and worded as HELLO.
    "redis-login-retried": (
        "orchestrator/connections.py",
        "        raise redis_refusal(url, refused) from None",
        "        raise AccessRefused(url) from None",
        ("tests/test_access.py::test_a_redis_password_missing_or_wrong_is_one_line_and_exit_2",),
    ),
    # A '[...]' in a password: urlsplit's own error quoted what the brackets held.
    "urlsplit-error-quoted": (
        "orchestrator/settings.py",
        "    except ValueError:  # a '[...]' in the user or password read as an IPv6 host, quoted\n"
        "        raise ValueError(RESERVED) from None",
        "    except ValueError:  # a '[...]' in the user or password read as an IPv6 host, quoted\n"
        "        raise",
        ("tests/test_cli.py::test_a_password_left_unencoded_is_refused_without_a_piece_of_it",),
    ),
    # A service gave up at the first refused login: a user an operator makes a moment after
    # the pod crash-looped it.
    "access-refused-not-retried": (
        "orchestrator/connections.py",
        "                if time.monotonic() + pause > refused_until:",
        "                if True:",
        (
            "tests/test_access.py::test_a_wrong_password_is_one_line_and_exit_2_at_once_for_commands_and_services",
        ),
    ),
    # A password left unencoded split its URL: its pieces were quoted, or read as a port.
    "url-password-pieces": (
        "orchestrator/settings.py",
        '    if parts.netloc and "@" not in parts.netloc and "@" in url:',
        "    if False:",
        ("tests/test_cli.py::test_a_password_left_unencoded_is_refused_without_a_piece_of_it",),
    ),
    # An option of no Redis connection passed, and failed as a traceback at the first command.
    "redis-url-options-unchecked": (
        "orchestrator/settings.py",
        "            ConnectionPool.from_url(value).make_connection()",
        "            ConnectionPool.from_url(value)",
        ("tests/test_cli.py::test_bad_flags_and_settings_are_refused_in_one_line_with_exit_2",),
    ),
    # A refusal of an unknown pool named a bag's pool where its member named its own.
    "pool-path-of-the-bag": (
        "orchestrator/program.py",
        '                named = f"{where}.pool" if member.pool else f"{path}.pool"',
        '                named = f"{path}.pool"',
        (
            "tests/test_program.py::test_every_task_and_pool_is_found_at_the_path_a_fault_would_name",
        ),
    ),
    # A compensation's task and pool went unwalked: an unknown one would be refused unnamed.
    "leaf-paths-skip-compensations": (
        "orchestrator/program.py",
        "            if member.compensate is not None:\n                yield (",
        "            if False:\n                yield (",
        (
            "tests/test_program.py::test_every_task_and_pool_is_found_at_the_path_a_fault_would_name",
        ),
    ),
    # `dead --requeue` read on past the letters there at its start: one refused again went round.
    "requeue-reads-its-own-returns": (
        "orchestrator/bus.py",
        "            while sent + kept < min(most, ready) and kept < MAX_DEAD_HELD:",
        "            while sent + kept < most and kept < MAX_DEAD_HELD:",
        (
            "tests/test_ingress.py::test_a_requeue_sends_each_letter_once_though_the_router_refuses_it_again",
        ),
    ),
    # `dead --requeue` trusted the header naming a letter's queue: any queue of the vhost.
    "requeue-trusts-the-header": (
        "router/dead_letters.py",
        "    if not isinstance(source, str) or not our_queue(names, source):",
        "    if not isinstance(source, str):",
        (REQUEUE,),
    ),
    # A letter sent back with its failures counted and its reasons: parked again at once.
    "requeue-keeps-the-count": (
        "router/dead_letters.py",
        "    return source, {**kept, FAILURES: 0}",
        "    return source, dict(headers)",
        (REQUEUE,),
    ),
    # The CLI waited for the broker's confirm for a whole alarm, and printed no id meanwhile.
    "cli-waits-for-a-blocked-broker": (
        "shardflow/cli.py",
        "        return await within(call, BROKER_WAIT_S)\n",
        "        return await call\n",
        (
            "tests/test_alarms.py::test_the_cli_says_what_waits_for_a_blocked_broker_and_prints_the_id",
        ),
    ),
    # A full Redis (OOM) counted against each message: all in flight parked within 10 s.
    "redis-refusals-counted": (
        "orchestrator/delivery.py",
        "    unreachable = waits_for_services(exc)\n",
        "    unreachable = isinstance(exc, UNCOUNTED)\n",
        ("tests/test_delivery.py::test_redis_refusing_writes_is_never_counted_against_a_message",),
    ),
    # A refused record sent the task message back: its handlers ran again at every try.
    "refused-record-reruns-handlers": (
        "worker/pool.py",
        "                if given_up or not waits_for_services(exc):\n",
        "                if True:\n",
        (FULL_REDIS,),
    ),
    # A full Redis still answers PING: /healthz stayed green while nothing could be written.
    "health-blind-to-refusals": (
        "orchestrator/health.py",
        "            elif refused is not None:\n",
        "            elif False:\n",
        (FULL_REDIS,),
    ),
    # One of four shards' consumers refused for good: the process still said it was ready.
    "ready-with-any-consumer": (
        "orchestrator/lifecycle.py",
        "return started > 0 and started >= self._wanted and not self._stop.is_set()",
        "return started > 0 and not self._stop.is_set()",
        (
            "tests/test_lifecycle.py::test_a_part_with_a_consumer_that_cannot_start_is_not_consuming",
        ),
    ),
    # A consumer the broker took back counted until its holder read it: a busy worker, never.
    "ready-with-a-taken-consumer": (
        "orchestrator/lifecycle.py",
        'started = sum(1 for iterator in self._iterators if getattr(iterator, "live", True))',
        "started = len(self._iterators)",
        (
            "tests/test_lifecycle.py::test_a_part_whose_consumer_the_broker_took_back_is_not_consuming",
        ),
    ),
    "consumer-live-until-read": (
        "orchestrator/consuming.py",
        "        return self._lost is None and not self._ended and not self._closed",
        "        return not self._closed",
        (
            "tests/test_consuming.py::test_a_consumer_the_broker_ended_is_not_live_before_anyone_reads_it",
        ),
    ),
    # An outage logged a line for every message requeued: 125 in 30 s for 5 in flight.
    "requeue-lines-unquiet": (
        "orchestrator/delivery.py",
        "    if now - last < QUIET_S:\n",
        "    if False:\n",
        (
            "tests/test_delivery.py::test_an_outage_logs_a_line_a_queue_every_few_seconds_not_one_a_message",
        ),
    ),
    # A bundle's ghost task was logged as parked with the fields of the task run before it.
    "log-fields-leak-in-bundles": (
        "worker/pool.py",
        "        logs.scope(workflow_id=task.wf, step=task.path, task=task.task)\n",
        "",
        ("tests/test_bundling.py::test_the_lines_about_a_bundles_task_name_it_not_the_one_before",),
    ),
    # A router ten minutes ahead pinned its programs atop `list`.
    "index-on-local-clock": (
        "orchestrator/marks.py",
        "return int(await self.clock.now() * 1000)",
        "return int(time.time() * 1000)",
        (CLOCKS + "test_a_router_and_a_purge_ahead_of_redis_keep_to_redis_s_clock",),
    ),
    # `purge --older-than 10m` from a terminal fifteen minutes ahead took what just ended.
    "purge-on-local-clock": (
        "router/retention.py",
        "cutoff_ms = int((await store.now() - older_than_s) * 1000)",
        'cutoff_ms = int((__import__("time").time() - older_than_s) * 1000)',
        (CLOCKS + "test_a_router_and_a_purge_ahead_of_redis_keep_to_redis_s_clock",),
    ),
    # A program started past its deadline ran its first step, then its deadline ended it.
    "start-past-deadline-runs": (
        "orchestrator/transitions.py",
        "if await self._past_deadline(state, plan, run):",
        "if False:",
        (CLOCKS + "test_a_program_past_its_deadline_at_its_start_runs_no_step",),
    ),
    # A handler that catches its cancel runs on once its slot is free: tasks_running said 0.
    "left-handlers-uncounted": (
        "worker/pool.py",
        "left.set_function(lambda: len(self._left) + self.threads.left_behind)",
        "left.set_function(lambda: self.threads.left_behind)",
        (DEAF,),
    ),
    # A queue that answers 404 is tried every second for hours: a channel, and 4.3 KB, a try.
    "refused-start-not-backed-off": (
        "orchestrator/lifecycle.py",
        "pause = min(RECONSUME_S * 2 ** max(0, refused - 1), REFUSED_MAX_S)",
        "pause = RECONSUME_S",
        (
            "tests/test_lifecycle.py::"
            "test_a_queue_that_refuses_each_start_is_tried_again_later_and_later",
        ),
    ),
    # `dead --purge --older-than` deletes whatever it meets, young or old.
    "dead-purge-ignores-age": (
        "orchestrator/bus.py",
        "                if old is not None and not old(dict(message.headers or {})):\n",
        "                if False:\n",
        ("tests/test_cli.py::test_dead_purge_deletes_all_or_those_parked_before_a_time_in_order",),
    ),
    # Keys counted as nothing: an input or args of many keys hold 2.2 times what is counted.
    "json-bytes-without-keys": (
        "orchestrator/caches.py",
        '        + KEY_BYTES * text.count(b":")\n',
        "",
        (PARSE_BYTES, READ_BYTES),
    ),
    # A router keeps a plan of an id purged and submitted again: signals are checked against
    # the old program's.
    "router-keeps-a-stale-plan": (
        "router/client.py",
        "        if name not in names:  # the plan kept may be of an id purged and",
        "        if False:  # the plan kept may be of an id purged and",
        (ROUTER_PLANS,),
    ),
    # ... and one whose program is gone.
    "router-keeps-a-missing-plan": (
        "router/client.py",
        "            self._plans.pop(workflow_id)  # purged or expired",
        "            pass  # purged or expired",
        (ROUTER_PLANS,),
    ),
    # Status (and cancel, redrive) from the plan kept: an id purged and submitted again shows
    # the old program's steps, and a cancel decides on its compensations.
    "router-status-from-a-kept-plan": (
        "router/client.py",
        "        if fresh:\n            return await self.store.plan(workflow_id)\n",
        "",
        (ROUTER_PLANS,),
    ),
    # A start's advance is given no run: an owner that stalled between reading the state
    # and its advance moves a run redriven meanwhile to a step of the old one, and the
    # redrive's start is stale: a running program with nothing in flight.
    "start-advances-any-run": (
        "orchestrator/transitions.py",
        '            epoch = run = int(state.get("epoch") or 0)',
        '            run = int(state.get("epoch") or 0)',
        (STALLED_START, STALLED_START_LUA),
    ),
    # take.lua checks no run: a stalled signal handler takes the signal for a redriven run
    # and sends a stale `next`; the step waits on with its signal gone.
    "take-checks-no-run": (
        "lua/take.lua",
        'if epoch ~= "" and epoch ~= (s[4] or "0") then\n  return {"stale"}',
        'if false then\n  return {"stale"}',
        (STALLED_TAKE_LUA,),
    ),
    "take-given-no-run": (
        "orchestrator/transitions.py",
        "        verdict = await self.store.take(wf, path, step.signal, epoch)",
        "        verdict = await self.store.take(wf, path, step.signal)",
        (STALLED_TAKE, STALLED_TAKE_LUA),
    ),
    # A lane's task runs on after its delivery's channel closed: the broker hands it to the
    # standby, and two of the lane's tasks run at once.
    "lane-task-outlives-its-delivery": (
        "worker/pool.py",
        "        if is_lane(self.pool) and isinstance(delivery, Incoming):",
        "        if False:",
        (LANE_DROP, CONSUMER_TIMEOUT),
    ),
    # A channel closed by consumer_timeout is not named: tasks over 30 min run again and again.
    "ack-timeout-unnamed": (
        "orchestrator/consuming.py",
        "        if ACK_TIMED_OUT in str(reason):",
        "        if False:",
        (CONSUMER_TIMEOUT,),
    ),
    # No local clock on a slot's lease: a worker that cannot reach Redis runs on past it, while
    # another worker takes the slot.
    "lease-kept-while-unrenewed": (
        "worker/pool.py",
        "        expires = since + lease_s\n",
        "        expires = math.inf\n",
        (LEASE_RUNS_OUT,),
    ),
    # An untrack drops a program a redrive opened again since its caller read it ended: it
    # runs outside its shard's live set.
    "untrack-drops-a-reopened-program": (
        "orchestrator/store.py",
        "    return status is not None and status not in TERMINAL and found_owner == str(owner)",
        "    return False",
        (LATE_UNTRACK, LATE_UNTRACK_LUA),
    ),
    # A refusal names the message's own keys raw: a key with a line break forges a log line.
    "reason-keys-raw": (
        "orchestrator/delivery.py",
        "    loc = tuple(part if isinstance(part, int) else key_name(part) for part in first"
        '["loc"])\n',
        '    loc = tuple(first["loc"])\n',
        (SHARD_REASON,),
    ),
    # pydantic's message taken raw: a `kind` matching no tag is repeated with its escapes.
    "reason-message-raw": (
        "orchestrator/delivery.py",
        "{printable(first['msg'].removeprefix('Value error, '))}{more}",
        "{first['msg'].removeprefix('Value error, ')}{more}",
        (SHARD_REASON,),
    ),
    # A reason nobody escaped at its source is parked (and answered) as it is.
    "describe-unescaped": (
        "orchestrator/delivery.py",
        "    text = printable(first_error(exc) if isinstance(exc, ValidationError) else "
        "str(exc))\n",
        "    text = first_error(exc) if isinstance(exc, ValidationError) else str(exc)\n",
        (REASON_ESCAPED,),
    ),
    # A program's fault names its unknown keys raw.
    "program-fault-keys-raw": (
        "orchestrator/program.py",
        "        name = str(part) if isinstance(part, int) else key_name(part)\n",
        "        name = str(part)\n",
        (PROGRAM_FAULTS,),
    ),
    # A program's fault repeats what pydantic repeats (CEL's error quoting the source) raw.
    "program-fault-message-raw": (
        "orchestrator/program.py",
        '    message = printable(error["msg"].removeprefix("Value error, "))\n',
        '    message = error["msg"].removeprefix("Value error, ")\n',
        (PROGRAM_FAULTS,),
    ),
    # An argument given in args and args_from is named raw.
    "args-from-key-raw": (
        "orchestrator/program.py",
        'f"{where}.args_from.{key_name(name)}: also in args; give it in one"',
        'f"{where}.args_from.{name}: also in args; give it in one"',
        (PROGRAM_FAULTS,),
    ),
    # The dead-letter log line takes the reason as it is: one unescaped reason forges lines.
    "dead-letter-logged-raw": (
        "orchestrator/bus.py",
        '"dead-lettering a message from %s: %r", source, reason',
        '"dead-lettering a message from %s: %s", source, reason',
        (REFUSAL_LOGGED,),
    ),
    # `submit --wait` prints a failed handler's error raw: OSC 52 writes the clipboard.
    "submit-error-raw": (
        "shardflow/cli.py",
        '    error = clean(status["error"], 2000)\n',
        '    error = status["error"]\n',
        (SUBMIT_ERROR,),
    ),
    # The ingress binds the request's id before checking it: a 500,000-character log line.
    "ingress-binds-unchecked-id": (
        "router/ingress.py",
        "checked_id(request.workflow_id or derived_id(message_id, delivery.body))",
        "request.workflow_id or derived_id(message_id, delivery.body)",
        (HUGE_ID,),
    ),
    # `clean()` lets U+2028 and U+2029 through: line breaks to a log reader or an editor.
    "clean-keeps-separators": (
        "router/listing.py",
        '_UNSAFE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})',
        '_UNSAFE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})',
        (CLEAN_SEPARATORS,),
    ),
    # `explain` quotes a name with !r after clean(): an escape shown as `\\x1b`.
    "explain-escapes-twice": (
        "router/explain.py",
        '    name = f" {_quoted(clean(report[\'name\'], 200))}" if report["name"] else ""\n',
        '    name = f" {clean(report[\'name\'], 200)!r}" if report["name"] else ""\n',
        (EXPLAIN_QUOTED,),
    ),
    # The health port serves every connection, a thread each: half-sent requests hold a thread
    # apiece for as long as their clients stay.
    "http-connections-unbounded": (
        "orchestrator/health.py",
        "        if not self.slots.acquire(blocking=False):",
        "        if False:",
        (IDLE_HTTP,),
    ),
    # A cancel's reason is stored (and logged) whole, however long.
    "cancel-reason-uncut": (
        "orchestrator/ending.py",
        "    if len(reason) > MAX_ERROR:",
        "    if False:",
        (CANCEL_CUT,),
    ),
    # A cancel's reason is logged raw: a line break in it forges a log line.
    "cancel-reason-logged-raw": (
        "orchestrator/ending.py",
        '        log.info("%s: ended %s: %r", wf, ended.status, reason)',
        '        log.info("%s: ended %s: %s", wf, ended.status, reason)',
        (CANCEL_LOG,),
    ),
    # A redrive does not ask whether a shard outside the ring is still served: the program is
    # set pending and its start finds no queue (or waits in an unconsumed one) for ever.
    "redrive-off-ring-unchecked": (
        "router/client.py",
        "        if owner >= self.settings.shards:",
        "        if False:",
        (REDRIVE_OFF_RING,),
    ),
    # Any finished step's pool takes a label,
    # a map's over no items too: junk pools use up the labels of the pools that run.
    "pool-label-taken-by-any-step": (
        "orchestrator/metrics.py",
        '    if kind == "task":\n        return pool_label(pool)\n'
        '    return pool if pool in _pool_labels else "other"',
        "    return pool_label(pool)",
        (POOL_LABELS,),
    ),
    # A lane task's watch on its channel is left behind: a callback (1 KB) per task, for good.
    "lane-watch-kept": (
        "worker/pool.py",
        "            gone.cancel()  # an observer: its callback on the channel goes with it\n",
        "",
        (LANE_WATCH,),
    ),
    # The health port's connections have a timeout per read only: a trickle holds a slot.
    "http-no-connection-deadline": (
        "orchestrator/health.py",
        "        if timeout_s is not None:\n            self._deadline = threading.Timer(",
        "        if False:\n            self._deadline = threading.Timer(",
        (HTTP_TRICKLE,),
    ),
    # A share's queue pool name takes a label: `parallel.3` and the like use them up.
    "pool-label-of-a-share-queue": (
        "orchestrator/transitions.py",
        "metrics.pool_label(pool_of_share(pool))",
        "metrics.pool_label(pool)",
        (POOL_LABELS,),
    ),
    # A renewal error other than an unreachable Redis ends the lease's watch: a read-only
    # replica after a failover, and the handler runs past its lease.
    "renew-error-ends-the-watch": (
        "worker/pool.py",
        "            except Exception as exc:  # unreachable, read-only after a failover: the next",
        "            except OSError as exc:  # unreachable, read-only after a failover: the next",
        (LEASE_RUNS_OUT,),
    ),
    # Plain-function handlers on asyncio's default executor: 6 at once on 2 cores, whatever the
    # worker's concurrency.
    "handlers-on-the-default-executor": (
        "worker/registry.py",
        "        if threads is not None:\n",
        "        if False:\n",
        (HANDLER_THREADS,),
    ),
    # The worker's pool sized as asyncio's default one.
    "handler-threads-too-few": (
        "worker/threads.py",
        "        self.size = 2 * concurrency\n",
        "        self.size = 6\n",
        (HANDLER_THREADS,),
    ),
    # A handler left running in its thread is neither counted nor kept: a worker filling with
    # stuck handlers says nothing, and a lane waits for nothing (two of its tasks at once).
    "left-behind-uncounted": (
        "worker/threads.py",
        "                    self._running_on.add(running)\n",
        "                    pass\n",
        (
            LEFT_BEHIND,
            HANDLER_FAULTS + "test_a_lane_waits_for_a_handler_that_runs_on_past_its_timeout",
        ),
    ),
    # A handler's exception text taken as it is: a __str__ that raises fails the delivery, so
    # the handler ran 20 times and its program stayed running.
    "exception-text-unguarded": (
        "worker/pool.py",
        'error = _cut(_said(exc) if plain else f"{type(exc).__name__}: {_said(exc)}")',
        'error = _cut(str(exc) if plain else f"{type(exc).__name__}: {exc}")',
        (UNPRINTABLE,),
    ),
    # A cancelled handler waited for without a bound: one that catches its cancel holds its
    # slot, and its task fails only once it returns.
    "cancelled-handler-awaited-for-ever": (
        "worker/pool.py",
        "                if not await end_tasks([handler], what, HANDLER_END_S):",
        "                if not await end_tasks([handler], what, 3600):",
        (DEAF,),
    ),
    # A handler given the message's own values: what it changes reaches its retry.
    "handler-shares-its-values": (
        "worker/pool.py",
        "    return copy.deepcopy(value) if isinstance(value, dict | list) else value",
        "    return value",
        (POPS,),
    ),
    # A process whose worker left a handler running that refuses its cancel waits for it at
    # its exit, for good.
    "exit-waits-for-a-deaf-task": (
        "shardflow/cli.py",
        "    leave(code)\n",
        "    pass\n",
        (DEAF_EXIT,),
    ),
    # RabbitMQ's connect waits without a bound: a port that never answers holds a command for
    # good.
    "amqp-connect-unbounded": (
        "orchestrator/bus.py",
        "            await connection.connect(timeout=CONNECT_TIMEOUT_S)",
        "            await connection.connect()",
        (WRONG_SERVICES,),
    ),
    # No node of a Redis Cluster reached is no outage: a traceback, pods crash-looping.
    "cluster-fault-not-an-outage": (
        "orchestrator/delivery.py",
        "    RedisClusterUnreachableError,  # no node of a Redis Cluster reached\n",
        "",
        (WRONG_SERVICES,),
    ),
    # A connection fault names no service: which URL to fix is a guess.
    "connect-fault-names-no-service": (
        "shardflow/cli.py",
        "    if isinstance(exc, RedisError | RedisClusterException):",
        "    if False:",
        (SERVICES_DOWN,),
    ),
    # An --app module that fails at import is a traceback.
    "app-import-fault-raw": (
        "shardflow/cli.py",
        "    except (Exception, SystemExit) as exc:  # the module failed: a syntax error, a "
        "sys.exit()\n",
        "    except ImportError as exc:  # the module failed: a syntax error, a sys.exit()\n",
        (APP_AND_STDOUT,),
    ),
    # A full stdout reported as a connection fault (exit 4).
    "stdout-fault-as-connection": (
        "shardflow/cli.py",
        "    except OSError as exc:  # a full disk, say: not a connection's fault",
        "    except BrokenPipeError as exc:  # a full disk, say: not a connection's fault",
        (APP_AND_STDOUT,),
    ),
    # An AMQP port out of range passes the settings, and is a traceback at connect.
    "amqp-port-unchecked": (
        "orchestrator/settings.py",
        "        parts.port  # noqa: B018",
        "        parts.hostname  # noqa: B018",
        (BAD_FLAGS,),
    ),
    # A plain function's thread still running at the stop is not looked at: Python waits for
    # it at its exit, for good.
    "exit-waits-for-a-stuck-thread": (
        "shardflow/cli.py",
        "    if ended and not threads:\n",
        "    if ended:\n",
        (STUCK_THREAD_EXIT,),
    ),
    # A handler of a cancelled program is waited for as long as it runs on: one that catches
    # its cancel holds its slot until it returns (a lane's next task waits for it on purpose).
    "cancelled-programs-handler-awaited": (
        "worker/pool.py",
        "                stop.set_result(None)\n",
        "                pass\n",
        (DEAF_CANCELLED,),
    ),
    # A deadline or a signal for a program purged under its cached plan is taken for a live
    # one: counted `missing` or `kept`, never `gone`, so no metric shows it.
    "deadline-of-a-purged-program-not-gone": (
        "orchestrator/transitions.py",
        "        if not state:  # expired or purged since (its plan still cached)\n"
        "            return self._gone(message)\n        status",
        "        status",
        (PURGED_TIMERS,),
    ),
    "signal-for-a-purged-program-kept": (
        "orchestrator/transitions.py",
        "        if not state:  # expired or purged since (its plan still cached)\n"
        "            return self._gone(message)\n        if state",
        "        if state",
        (PURGED_TIMERS,),
    ),
    # A retry that waited past its program's end is dropped but not counted as a metric.
    "gone-retry-uncounted": (
        "worker/pool.py",
        '        metrics.GONE.labels("worker").inc(tasks)\n',
        "",
        (RETRY_GONE,),
    ),
    # The reason of a loss or of a failed reconnect is dropped: /healthz says only `not
    # connected`, and the reason is in the logs alone.
    "connection-loss-unread": (
        "orchestrator/amqp_faults.py",
        "            self.reason = (fault(exc) if str(exc) else printable(repr(exc)))"
        "[:MAX_DOWN_REASON]",
        '            self.reason = ""',
        (CLOSED, ROTATED),
    ),
    # A Redis Cluster's refused login is taken for an outage: exit 4, waited for.
    "cluster-login-refusal-unwrapped": (
        "orchestrator/connections.py",
        "        exc = exc.__cause__  # type: ignore[assignment]",
        "        pass",
        (CLUSTER_LOGIN,),
    ),
    # A CancelledError of the handler's own code is taken for its program's cancel: nothing
    # is reported, and the program runs for good.
    "self-cancel-taken-for-a-program-cancel": (
        "worker/pool.py",
        "        if stop in done:\n            raise _ProgramCancelled",
        "        if stop in done or (handler in done and handler.cancelled()):\n"
        "            raise _ProgramCancelled",
        (MISHANDLED,),
    ),
    # A plain function's StopIteration reaches asyncio, which cannot set it on a future: the
    # handler's await never ends.
    "thread-stopiteration-passes": (
        "worker/threads.py",
        "        except (StopIteration, asyncio.CancelledError, futures.CancelledError) as exc:",
        "        except ZeroDivisionError as exc:",
        (MISHANDLED,),
    ),
    # An output with a lone surrogate passes: its report fails to encode 20 times, running the
    # handler each time, and the program runs for good.
    "output-surrogate-unchecked": (
        "worker/pool.py",
        '    if "\\\\ud" in text:',
        "    if False:",
        (UNCARRIED,),
    ),
    # An output nested past what the owner reads passes: its report is parked.
    "output-depth-unchecked": (
        "worker/pool.py",
        "    if deeper_than(output, MAX_DEPTH):",
        "    if False:",
        (UNCARRIED,),
    ),
    # An error's lone surrogate is kept: the failure report cannot be encoded.
    "error-surrogate-kept": (
        "worker/pool.py",
        '        error = error.encode(errors="backslashreplace").decode()',
        "        pass",
        (UNCARRIED,),
    ),
    # A failed handler's traceback is nowhere, even at debug.
    "handler-traceback-unlogged": (
        "worker/pool.py",
        "exc_info=None if plain else exc,",
        "exc_info=None,",
        (TRACEBACK,),
    ),
    # A TaskGroup's failure names only how many it holds.
    "exception-group-unnamed": (
        "worker/pool.py",
        "    if isinstance(exc, BaseExceptionGroup) and depth < MAX_GROUP_DEPTH:",
        "    if False:",
        (TRACEBACK,),
    ),
    # A lane task cut by its worker's stop is said to be a closed channel, and counted let go.
    "lane-stop-said-closed": (
        "worker/pool.py",
        "                if closed:",
        "                if gone.done():",
        (
            "tests/test_pools.py::"
            "test_a_lane_task_cut_by_its_workers_stop_is_not_said_to_be_a_closed_channel",
        ),
    ),
    # A lane's next task runs beside a handler that ran on past its timeout (a plain
    # function's thread, an async def that catches its cancel): two of the lane's at once.
    "lane-not-held-for-a-handler-left-running": (
        "worker/pool.py",
        "        return is_lane(self.pool) and bool(self._left or self.threads.left_behind)",
        "        return False",
        (HANDLER_FAULTS + "test_a_lane_waits_for_a_handler_that_runs_on_past_its_timeout",),
    ),
    # `true` passes as 1 where the schema says a number: one attempt, silently.
    "boolean-numbers-pass": (
        "orchestrator/program.py",
        "                if isinstance(data.get(field.alias or name), bool) and "
        "_numeric(field.annotation):",
        "                if False:",
        ("tests/test_program.py::test_a_boolean_is_no_number",),
    ),
    # A compensation's large item is read from where its step's output was, but not handed
    # to the handler: it undoes nothing it can name.
    "item-read-dropped": (
        "worker/pool.py",
        "            items[n] = json.loads(text)",
        "            items[n] = None",
        (LARGE_ITEMS,),
    ),
    # Every item is read by reference, however small: the owner names no small one so.
    "small-items-read-from-redis": (
        "orchestrator/transitions.py",
        "        if len(undo.output) > MAX_ITEM_BYTES",
        "        if True",
        (LARGE_ITEMS_MODEL,),
    ),
    # Every item carried, however large: a compensation's message as large as the output.
    "large-items-carried": (
        "orchestrator/transitions.py",
        "        if len(undo.output) > MAX_ITEM_BYTES",
        "        if False",
        (LARGE_ITEMS_MODEL,),
    ),
    # An item named where no output was recorded: the handler gets null, or the worker
    # fails on the message until the delivery limit, with no reason.
    "missing-item-unparked": (
        "worker/pool.py",
        "            if text is None:\n                member =",
        "            if False:\n                member =",
        (
            "tests/test_hostile.py::"
            "test_a_task_whose_item_is_read_from_an_output_never_recorded_is_parked",
        ),
    ),
    # A branch's task waiting for the lane is not said to: explain names an idle pool only.
    "branch-lane-unexplained": (
        "router/explain.py",
        '                entry["lane"] = await _lane(store, wf, pool_of(step))',
        '                entry["lane"] = None',
        ("tests/test_explain.py::test_the_serial_lane_and_a_bag_half_done",),
    ),
    # An --app module's sys.exit() at import ends the command with its text and exit 1.
    "app-import-exit-passes": (
        "shardflow/cli.py",
        "    except (Exception, SystemExit) as exc:  # the module failed",
        "    except Exception as exc:  # the module failed",
        ("tests/test_cli.py::test_an_app_that_fails_at_import_and_a_full_stdout_are_one_line",),
    ),
    # A lane task redelivered after its hold was cut (its channel closed) runs beside the
    # handler the hold waited for.
    "lane-hold-cut-runs-beside": (
        "worker/pool.py",
        "        if self._lane_busy():\n            await self._hold_lane(task, before=True)\n",
        "",
        (
            "tests/test_pools.py::"
            "test_a_lane_hold_cut_by_a_closed_channel_still_runs_no_task_beside_its_handler",
        ),
    ),
    # The outcomes of the threads a lane waited for are not taken: asyncio logs each
    # exception as never retrieved, at error.
    "settled-outcomes-unread": (
        "worker/threads.py",
        "                for wait in waits:  # their outcomes were the tasks' (reported then): "
        "dropped\n",
        "                for wait in []:\n",
        (HANDLER_FAULTS + "test_a_lane_waits_for_a_handler_that_runs_on_past_its_timeout",),
    ),
    # A large output's check is skipped where it goes to a thread.
    "large-output-unchecked": (
        "worker/pool.py",
        "            await asyncio.get_running_loop().run_in_executor(self._checks, _check_depth, "
        "output)\n",
        "            pass\n",
        (UNCARRIED,),
    ),
    # An escaped backslash before `ud800` (a string holding the text \\ud800) is read as a
    # surrogate's escape: a valid output refused.
    "escaped-backslash-read-as-escape": (
        "worker/pool.py",
        '_ESCAPES = re.compile(r"\\\\\\\\|',
        '_ESCAPES = re.compile(r"',
        (HANDLER_FAULTS + "test_the_output_text_check_refuses_a_lone_surrogate_and_nothing_else",),
    ),
    # A cancel's notice between a task's check and its handler's start is lost: the handler
    # runs until the worker's own check, 10 s later.
    "notice-before-start-lost": (
        "worker/pool.py",
        "        if self._ended_before(task):\n            raise _ProgramCancelled",
        "        if False:\n            raise _ProgramCancelled",
        (NOTICES,),
    ),
    # Only the bag's own branches are looked at: a nested branch's signal is named by no
    # command.
    "nested-signals-unnamed": (
        "router/explain.py",
        '        stack.extend(branch.get("branches") or ())',
        "        pass",
        (
            "tests/test_branches_e2e.py::"
            "test_explain_names_the_signal_command_for_signals_of_nested_branches",
        ),
    ),
    # A chunk's members split with their fields dumped: a member's item_from is a dict, and
    # the worker fails on it until the message is parked, no compensation of it run.
    "split-dumps-slots": (
        "orchestrator/messages.py",
        'self.model_copy(update={**dict(slot), "batch": []})',
        'self.model_copy(update={**slot.model_dump(), "batch": []})',
        (LARGE_ITEMS_MODEL,),
    ),
    # item_from taken on any path and any step: a forged task reads outputs it has no part in.
    "item-from-anywhere": (
        "orchestrator/messages.py",
        "        if named and not (",
        "        if False and not (",
        ("tests/test_wire_format.py::test_a_large_value_is_referred_to_or_carried_never_both",),
    ),
    # A notice that finds the program compensating stops a compensation not started yet.
    "compensating-notice-stops-compensations": (
        "worker/pool.py",
        '        return status != "compensating" or not (is_saga(task.path) or task.undoable)',
        "        return True",
        (
            "tests/test_cancel_notices.py::"
            "test_a_notice_that_finds_its_program_compensating_lets_a_compensation_start",
        ),
    ),
    # A redriven run's deadline shown as counted from the submission.
    "redriven-deadline-from-submission": (
        "router/explain.py",
        '        if report.get("run"):\n',
        "        if False:\n",
        ("tests/test_explain.py::test_an_ended_programs_deadline_is_what_was_left_at_its_end",),
    ),
    # `dead --purge --limit 1` deletes every letter.
    "dead-purge-limit-ignored": (
        "orchestrator/bus.py",
        "            if most is None:  # all, what came meanwhile too",
        "            if old is None:  # all, what came meanwhile too",
        ("tests/test_cli.py::test_dead_purge_deletes_all_or_those_parked_before_a_time_in_order",),
    ),
    # `dead --requeue --limit 1` sends every letter back.
    "dead-requeue-limit-ignored": (
        "shardflow/cli.py",
        "            most = args.limit or MAX_DEAD_PURGE",
        "            most = MAX_DEAD_PURGE",
        (
            "tests/test_cli.py::"
            "test_dead_requeue_sends_each_back_to_its_own_queue_and_keeps_the_rest",
        ),
    ),
    # A stale task ignored by a worker is not counted as a duplicate ignored.
    "stale-tasks-uncounted": (
        "worker/pool.py",
        '        metrics.DUPLICATES.labels("worker").inc(tasks)',
        "        pass",
        (
            "tests/test_hostile.py::"
            "test_no_handler_runs_for_an_unknown_program_or_a_step_its_program_left",
        ),
    ),
    # A timer however late is "due now".
    "overdue-timer-due-now": (
        "router/explain.py",
        "    if now - due < OVERDUE_MS:",
        "    if True:",
        (
            "tests/test_explain.py::test_a_timer_long_past_its_time_is_said_to_be_overdue_not_due_now",
        ),
    ),
    # An ended program's deadline goes on counting down.
    "ended-deadline-counts-down": (
        "router/explain.py",
        '        until = report["ended_ms"] or now',
        "        until = now",
        ("tests/test_explain.py::test_an_ended_programs_deadline_is_what_was_left_at_its_end",),
    ),
    # The unserved shard's warning waits its 3 s whatever --timeout says.
    "unserved-warning-after-the-timeout": (
        "shardflow/cli.py",
        "min(UNSERVED_AFTER_S, 0.8 * args.timeout)",
        "UNSERVED_AFTER_S",
        (
            "tests/test_cli.py::"
            "test_submit_wait_says_when_no_orchestrator_consumes_the_programs_shard",
        ),
    ),
    # A notice kept for a run before a redrive stops the next run's task: it never reports.
    "notice-outlives-its-run": (
        "worker/pool.py",
        "        if epoch != task.epoch:  # no notice",
        "        if epoch == -1:  # no notice",
        (NOTICES,),
    ),
    # A copy the broker gave back runs a second handler beside the run under way.
    "given-back-runs-beside": (
        "worker/runs.py",
        "            running = self._runs.get(key)\n",
        "            running = None\n",
        (GIVEN_BACK,),
    ),
    # A copy given back after its run ended runs again.
    "given-back-after-the-run-runs": (
        "worker/runs.py",
        "        created = await self._join(key, wf) or self._ran.get(key)\n",
        "        created = await self._join(key, wf)\n",
        (
            GIVEN_BACK,
            GIVEN_BACK_MODEL + "test_a_copy_given_back_after_its_run_ended_is_acked_and_not_run",
        ),
    ),
    # A task sent back to wait for a slot is remembered as run: at the waits' cap, the message
    # back from its wait is taken for a copy, acked, and the program waits for good.
    "slot-wait-remembered-as-run": (
        "worker/runs.py",
        "            kept = noted.created_ms if settled and not noted.withheld else None\n",
        "            kept = noted.created_ms if not noted.withheld else None\n",
        (
            GIVEN_BACK_MODEL
            + "test_a_task_sent_back_to_wait_for_a_slot_is_not_taken_for_one_that_ran",
        ),
    ),
    # A run that withheld the report a redelivered one sends (`again`, unflagged) counts as
    # run: the flagged copy that owes the `next` is acked unrun, and the program waits.
    "withheld-report-ignored": (
        "worker/pool.py",
        '        note_withheld(completion.verdict == "again" and not owed)\n',
        "",
        (
            GIVEN_BACK_MODEL + "test_a_copy_runs_when_the_run_here_withheld_the_report_it_owes",
            GIVEN_BACK_MODEL
            + "test_a_copy_waiting_for_a_run_that_withheld_its_report_runs_after_it",
        ),
    ),
    # A program of a reused id (purged, submitted again) is taken for the old one.
    "reused-id-taken-for-the-old": (
        "worker/runs.py",
        "        now = await self._created(wf)  # a copy's read only\n",
        "        now = created\n",
        (GIVEN_BACK_MODEL + "test_a_workflow_id_submitted_again_runs_its_task",),
    ),
    # Only a flagged copy looks for a run here: a bundle's task that ran from its own copy
    # runs again from the bundle's first try.
    "only-flagged-copies-looked-for": (
        "worker/pool.py",
        "            if await self.runs.ran_here(key, task.wf):\n",
        "            if redelivered(delivery) and await self.runs.ran_here(key, task.wf):\n",
        (GIVEN_BACK_MODEL + "test_a_bundle_given_back_runs_each_task_once_here",),
    ),
    # The memory of runs grows for good.
    "runs-kept-unbounded": (
        "worker/runs.py",
        "                    self._ran.popitem(last=False)\n",
        "                    pass\n",
        (GIVEN_BACK_MODEL + "test_the_memory_of_runs_is_bounded",),
    ),
    # The key leaves out the program's run (a redrive's task taken for the run before's).
    "given-back-key-without-epoch": (
        "worker/runs.py",
        "        task.epoch,\n        task.path,\n",
        "        0,\n        task.path,\n",
        (GIVEN_BACK_MODEL + "test_a_run_key_tells_apart_every_message_that_must_run_on_its_own",),
    ),
    # A failed run is remembered: a flagged copy that owes another delivery's `next` is acked.
    "failed-run-remembered": (
        "worker/pool.py",
        "        note_withheld(bool(reports))\n",
        "",
        (GIVEN_BACK_MODEL + "test_a_copy_runs_when_the_run_here_failed",),
    ),
    # A retry that finds its step recorded reports nothing (unless redelivered).
    "retry-withholds-a-recorded-step": (
        "worker/pool.py",
        "    return redelivered or task.attempt > 0\n",
        "    return redelivered\n",
        (RECORDED,),
    ),
    # A redelivered task whose step is recorded runs its handler again (a second run that
    # fails fails the program, its output recorded).
    "recorded-step-run-again": (
        "worker/pool.py",
        "        if not owed or first.undoable or is_saga(first.path):\n",
        "        if True:\n",
        (RECORDED,),
    ),
    # A chunk recorded in part runs every member again (a recorded one's second run that
    # fails fails the program).
    "recorded-members-run-again": (
        "worker/pool.py",
        "        return found\n",
        "        return [None] * len(tasks) if None in found else found\n",
        ("tests/test_given_back.py::test_a_chunk_recorded_in_part_runs_its_members",),
    ),
    # A limited task whose step is recorded waits for a slot to report it.
    "recorded-limited-waits-for-a-slot": (
        "worker/pool.py",
        "        if known[0] is not None:  # recorded already",
        "        if False:",
        (
            "tests/test_given_back.py::"
            "test_a_limited_task_whose_step_is_recorded_reports_it_without_a_slot",
        ),
    ),
    # A reused id's task and its duplicate, come together, both find only the old program's
    # run in the memory: the second runs beside the first.
    "reused-id-runs-beside": (
        "worker/runs.py",
        "        if created != now and key in self._runs:",
        "        if False:",
        (GIVEN_BACK_MODEL + "test_a_copy_of_a_reused_ids_task_waits_for_its_run_under_way",),
    ),
    # explain compares Redis's stamps with its own clock.
    "explain-on-its-own-clock": (
        "router/explain.py",
        "    now = await store.now() * 1000\n",
        "    now = time.time() * 1000\n",
        ("tests/test_explain.py::test_explain_reads_now_on_redis_clock_not_its_own",),
    ),
    # A taken metrics port's OSError becomes the context of any later error of the service.
    "metrics-port-error-chained": (
        "orchestrator/health.py",
        "        server = None\n    if server is None:\n",
        "        server = None\n        yield None\n        return\n    if server is None:\n",
        (
            "tests/test_metrics_port_taken.py::test_serving_on_a_taken_port_yields_none_and_chains_nothing",
        ),
    ),
    # explain calls the lane held by a task whose run failed and waits for its retry.
    "lane-held-through-retry": (
        "router/explain.py",
        '    if attempt is not None and failed is not None and failed["attempt"] >= attempt:',
        "    if False:",
        ("tests/test_explain.py::test_a_program_waiting_for_a_retry",),
    ),
    # explain calls a lane free whenever an attempt of its task failed, its retry running too.
    "lane-free-while-its-retry-runs": (
        "router/explain.py",
        '    if attempt is not None and failed is not None and failed["attempt"] >= attempt:',
        "    if failed is not None:",
        (
            "tests/test_explain.py::"
            "test_the_lane_is_held_by_an_attempt_until_the_owner_marks_it_failed",
        ),
    ),
    # An unknown key of a program is refused with no hint of the field it resembles.
    "extra-key-no-hint": (
        "orchestrator/program.py",
        '        message += _extra_hint(error["loc"])\n',
        "        pass\n",
        ("tests/test_program.py::test_invalid_programs_name_the_path_of_the_fault",),
    ),
    # SHARDFLOW_REDIS_MAX_CONNECTIONS is read by nobody: a connection for every command.
    "redis-pool-unbounded": (
        "orchestrator/redis_store.py",
        "        elif settings.redis_max_connections:\n",
        "        elif False:\n",
        (
            "tests/test_redis_pool.py::"
            "test_a_process_opens_no_more_redis_connections_than_its_bound",
        ),
    ),
    # A channel close is cancelled with its caller (a stop): aiormq sends a second close and
    # RabbitMQ closes the whole connection, the publisher channel with it.
    "close-cancelled-with-its-caller": (
        "orchestrator/bus.py",
        "    await asyncio.wait({closing}, timeout=CLOSE_TIMEOUT_S)"
        "  # a cancel leaves `closing` be\n",
        "    await within(closing, CLOSE_TIMEOUT_S)\n",
        (
            "tests/test_consuming.py::"
            "test_a_channel_close_cut_short_by_a_stop_leaves_the_connection_up",
        ),
    ),
    # The key leaves out the attempt: a retry redelivered is taken for a copy of the first.
    "given-back-key-without-attempt": (
        "worker/runs.py",
        "        task.attempt,\n        task.index,\n",
        "        0,\n        task.index,\n",
        (GIVEN_BACK_MODEL + "test_a_copy_given_back_after_its_run_ended_is_acked_and_not_run",),
    ),
}


def stale(names: list[str]) -> list[str]:
    """The mutants whose old text is not exactly once in their file (the code moved on)."""
    faults = []
    for name in names:
        path, old, _, _ = MUTANTS[name]
        found = (ROOT / path).read_text().count(old)
        if found != 1:
            faults.append(f"{name}: its old text occurs {found} times in {path}, not once")
    return faults


def run(name: str, scratch: Path, profile: str = "catch") -> str:
    path, old, new, tests = MUTANTS[name]
    target = scratch / path
    text = target.read_text()
    if text.count(old) != 1:  # checked up front too; the copy may differ if edited since
        raise SystemExit(f"{name}: the code it mutates has changed in {path}")
    target.write_text(text.replace(old, new))
    try:
        return "".join(_catch(name, test, scratch, profile) for test in tests)
    finally:
        target.write_text(text)


def _catch(name: str, test: str, scratch: Path, profile: str) -> str:
    started = time.monotonic()
    result = subprocess.run(
        [
            str(ROOT / ".venv/bin/pytest"),
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "--timeout=1800",
            test,
        ],
        cwd=scratch,
        env={"HYPOTHESIS_PROFILE": profile, **os.environ, "PYTHONPATH": str(scratch)},
        capture_output=True,
        text=True,
    )
    took = time.monotonic() - started
    by = test.split("::")[1]
    if result.returncode == 0:
        return f"## {name}: NOT CAUGHT by {by} ({took:.0f}s)\n"
    (scratch / "pytest.out").write_text(result.stdout)
    lines = [line.strip(" |E") for line in result.stdout.splitlines()]
    errors = sorted(
        {
            re.sub(r"\bw[0-9a-f]{8}\b", "wf", line)
            for line in lines
            if re.match(r"^(AssertionError|Failed|\w+Error): ", line)
        }
    )
    examples: list[list[str]] = []
    current: list[str] | None = None
    for line in lines:
        if line == "state = Cluster()":
            current = []
        elif current is not None and current and current[-1].count("(") > current[-1].count(")"):
            current[-1] += " " + line  # a call printed over several lines
        elif current is not None and re.match(r"state\.(?!barriers|nothing|programs)", line):
            current.append(line)
            if line == "state.teardown()":
                examples.append(current)
                current = None
    if not examples and "Falsifying example:" in result.stdout:  # a @given test
        after = result.stdout.split("Falsifying example:", 1)[1].splitlines()[1:]
        examples.append([line.strip(" |") for line in after if line.strip(" |")][:12])
    shortest = min(examples, key=len) if examples else ["(none printed)"]
    return (
        f"## {name}: caught by {by} in {took:.0f}s\n"
        + "\n".join(errors)
        + "\nshortest example printed:\n    "
        + "\n    ".join(shortest)
        + "\n"
    )


def main() -> None:
    args = sys.argv[1:]
    check = "--check" in args
    profile = "default" if "--shrink" in args else "catch"
    names = [arg for arg in args if arg not in ("--check", "--shrink")] or list(MUTANTS)
    unknown = [name for name in names if name not in MUTANTS]
    if unknown:
        raise SystemExit(f"no such mutant: {', '.join(unknown)}; known: {', '.join(MUTANTS)}")
    faults = stale(names)
    if faults:
        raise SystemExit("\n".join(faults))
    if check:
        print(f"{len(names)} mutants apply")
        return
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            copy = Path(scratch) / name
            # Without .hypothesis: failures saved by earlier runs must not hand over the answer.
            ignore = shutil.ignore_patterns(
                ".venv", ".git", "__pycache__", ".*_cache", ".tools", ".hypothesis"
            )
            shutil.copytree(ROOT, copy, ignore=ignore)
            print(run(name, copy, profile), flush=True)


if __name__ == "__main__":
    main()
