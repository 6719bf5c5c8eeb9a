"""What a command's record says of a stop that its escalation had to end by SIGKILL."""

from __future__ import annotations

from subagent.tools.commands import CommandOutcome, format_outcome


def test_a_command_the_daemons_sigterm_ended_says_what_it_started_was_sigkilled() -> None:
    # The daemon's path A SIGTERMs a command's group as it signals the runner: its shell may
    # die of it before the runner's stop interrupts it (``by_stop`` set afterwards, not
    # ``interrupted``). Its escalation's SIGKILL at the end of the grace went unsaid then
    # (1 run in 2 of the test above).
    out = CommandOutcome(1234, -15, "", False, by_stop=True, killed_after_grace=True)
    assert format_outcome(out) == (
        "[killed by SIGTERM] [interrupted by the stop: the command was stopped; it had written no output] "
        "[what it started did not end on SIGTERM: SIGKILLed at the end of the grace]\n"
    )
