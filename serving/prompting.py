"""From a parsed request to prompt token ids and a token budget (chat templates, completion prompts, limits)."""

from __future__ import annotations

from specdec_kit.serving import errors
from specdec_kit.serving.protocol import ChatCompletionRequest, CompletionRequest

# Used when the tokenizer has no chat template of its own (the demo zoo's code model has none).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def ensure_chat_template(tokenizer) -> None:
    """Chat prompts are built by the tokenizer's own template; one without gets a plain role-prefix format."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE


def chat_prompt(tokenizer, body: ChatCompletionRequest) -> tuple[list[int], int | None]:
    """The chat template applied to the messages (``developer`` is a system message) -> (ids, requested tokens)."""
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    return ids, body.max_completion_tokens or body.max_tokens


def completion_prompt(tokenizer, body: CompletionRequest, vocab_size: int) -> tuple[list[int], int]:
    """A text or token-id prompt (one per request) -> (ids, requested tokens; OpenAI's default is 16)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise errors.unsupported("prompt", "one prompt per request (got a batch of %d)" % len(prompt))
        prompt = prompt[0]
    ids = list(prompt) if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
    if not ids:
        raise errors.invalid("'prompt' is empty", "prompt")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise errors.invalid(f"prompt token ids must be integers in [0, {vocab_size})", "prompt")
    return ids, body.max_tokens if body.max_tokens is not None else 16


def token_budget(prompt_len: int, requested: int | None, max_context: int) -> int:
    """The tokens a request may generate: what it asked for, or the rest of the context; refused past it."""
    if requested is None:
        if prompt_len >= max_context:
            raise errors.context_length(prompt_len, 1, max_context)
        return max_context - prompt_len
    if prompt_len + requested > max_context:
        raise errors.context_length(prompt_len, requested, max_context)
    return requested
