"""Render chat messages through a tokenizer's Jinja chat template (sandboxed).

HF chat templates are Jinja2 programs; they run in jinja2's immutable sandbox
with the variables HF passes (``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``) and HF's ``raise_exception`` helper. jinja2 is
imported when a template is first compiled, so servers without chat input
never need it.
"""

from __future__ import annotations

from collections.abc import Sequence


class ChatTemplate:
    """A compiled chat template; :meth:`render` raises ``ValueError('messages: ...')`` on failure."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover - jinja2 ships with the grpc extra
            raise ValueError("messages: chat input needs jinja2 on the server (pip install jinja2)") from e

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"messages: the server's chat template does not compile: {e}") from e
        self._error = jinja2.TemplateError
        self._bos, self._eos = bos_token, eos_token

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self._bos, eos_token=self._eos)
        except self._error as e:
            raise ValueError(f"messages: the chat template rejected the conversation: {e}") from e
