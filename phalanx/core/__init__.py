"""The pure scheduling core: topology, capacity, placement and queue order over in-memory data.

No gRPC, no SQL, no wall clock, no logging set-up: the scheduler service, the trace simulator and the tests all
call these functions, and get decisions back as data. The only time read is a duration: the budgets of a
placement's exact search and of a backfill pass (perf_counter), off unless the caller sets them (the simulator
does not, so its replays are deterministic).
"""
