"""Stand-ins for host software on simulated hosts (`phalanx-agent --simulate`): programs that behave like the real
ones closely enough for the agent to drive them, with no GPU or driver."""
