"""The pure scheduling core: topology, capacity, placement and queue order over in-memory data.

No gRPC, no SQL, no clock reads, no logging set-up: the scheduler service, the trace simulator and the tests all
call these functions, and get decisions back as data.
"""
