"""What one request may hold: each bound is far beyond what a client needs, and bounds the work one
request can make for everyone (a million stop strings once slowed every request 25x: they are
checked at every token)."""

from irminsul.engine.grammar_limits import MAX_OPTIONS
from irminsul.engine.sampling import MAX_LOGIT_BIAS

MAX_DEPTH = 64  # nesting of JSON arrays and objects a request may use
MAX_STOP, MAX_STOP_CHARS = 16, 1024
MAX_MESSAGES, MAX_TOOLS, MAX_PARTS = 4096, 512, 16384  # MAX_PARTS: content parts in all a request's messages
MAX_CHOICES = 64  # n x prompts of one request
# OpenAI's bounds on metadata (it is echoed into the response and three of its stream events)
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_TEMPLATE_KWARGS = 64  # entries of chat_template_kwargs
# How many items each list- or map-valued field may hold, checked on the decoded JSON before
# anything walks it (validation holds Python's lock: a million items of an 8 MiB body are seconds
# in which no other thread runs). Fields of token ids are bounded by the context (`check_sizes`).
SIZE_BOUNDS = {
    "messages": MAX_MESSAGES,
    "input": MAX_MESSAGES,
    "tools": MAX_TOOLS,
    "stop": MAX_STOP,
    "stop_token_ids": MAX_STOP,
    "logit_bias": MAX_LOGIT_BIAS,
    "metadata": MAX_METADATA,
    "guided_choice": MAX_OPTIONS,
    "include": 16,
    "chat_template_kwargs": MAX_TEMPLATE_KWARGS,
}
ID_FIELDS = ("tokens", "token_ids")  # /detokenize's and publishing's
