"""The ``scripted`` provider: a deterministic model that plays a script in-process.

Invariants: which turn plays is derived from the history alone (the number of
assistant turns so far), exactly as ``subagent.model.fake_openai`` does over HTTP; delays are
real ``trio.sleep`` calls, so a stop can land mid-stream, but only there (pieces between
two delays are delivered at once); importing this module costs
nothing beyond trio (no ``openai``, no ``mcp``).
"""

from __future__ import annotations

from typing import Any

import trio

from subagent.model.provider import ModelError, TurnAssembler
from subagent.model.script import DEFAULT_SCRIPT, Script, history_position, plan

__all__ = ["ScriptedProvider"]


class ScriptedProvider:
    name = "scripted"

    def __init__(self, script: Script | None = None) -> None:
        self.script = script if script is not None else Script.from_dict(DEFAULT_SCRIPT)

    async def stream_turn(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sink: TurnAssembler
    ) -> None:
        turn_index, last_output = history_position(messages)
        for piece in plan(self.script, turn_index, last_output):
            if piece.kind == "delay":
                await trio.sleep(piece.seconds)
            elif piece.kind == "text":
                sink.text(piece.text)
            elif piece.kind == "tool_start":
                sink.tool_delta(piece.index, id=piece.id, name=piece.name)
            elif piece.kind == "tool_args":
                sink.tool_delta(piece.index, arguments=piece.text)
            elif piece.kind == "cut":
                return
            elif piece.kind == "error":
                raise ModelError(f"scripted model error: {piece.text}")
            elif piece.kind == "http_error":
                raise ModelError(f"the model server answered {piece.index}: {piece.text}", kind="model_http")
            elif piece.kind == "hang":
                await trio.sleep_forever()
            elif piece.kind == "finish":
                if piece.usage is not None:
                    sink.add_usage(piece.usage.get("prompt_tokens"), piece.usage.get("completion_tokens"))
                sink.finish(piece.text)
        # Pieces with no delay between them arrive together, as one network read would
        # deliver them: a stop lands only at a delay or a hang, which keeps tests exact.
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        return None
