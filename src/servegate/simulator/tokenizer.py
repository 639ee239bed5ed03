"""The built-in deterministic tokenizer, shared by the simulator and the router.

The router needs the simulator's exact token ids to compute prefix-cache keys, so
this module is a small public contract: `encode`, `decode`, `apply_chat_template`
and `encode_chat` give the same answer in every process, on every machine, for as
long as `TOKENIZER_VERSION` is unchanged.

How text becomes ids:

1. The text is split into pieces by one regular expression: a chat marker
   (`<|system|>`, `<|user|>`, `<|assistant|>`, `<|tool|>`, `<|end|>`, `<s>`,
   `</s>`), a run of ASCII letters with an optional leading space, up to three
   digits with an optional leading space, one other character with an optional
   leading space, or one whitespace character.
2. A piece that is a marker or a word of the built-in vocabulary (`the`,
   ` the`, ...) is one token.
3. Any other piece is UTF-8 encoded and cut into chunks of up to 3 bytes; each
   chunk is one token whose id encodes its bytes, so every text round-trips.

Id layout: 0-15 special tokens, then two ids per vocabulary word (bare, then with
a leading space), then 1-, 2- and 3-byte chunks. English prose comes out near
4 characters per token, like the BPE tokenizers of real models.

Chat template (deterministic, no Jinja): each message becomes
`<|{role}|>\n{content}<|end|>\n`, and `<|assistant|>\n` follows when a generation
prompt is wanted. Roles are `system`, `user`, `assistant`, `tool` (`developer`
is rendered as `system`); list content keeps its text parts joined by "\n".
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

TOKENIZER_VERSION = 1

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
SPECIAL_TOKENS: tuple[str, ...] = (
    "<unk>",
    "<s>",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
)
_NUM_SPECIAL = 16
_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}

_WORDS = """
the of and to a in is it you that he was for on are with as i his they be at one have
this from or had by hot but some what there we can out other were all your when up use
word how said an each she which do their time if will way about many then them would write
like so these her long make thing see him two has look more day could go come did my sound
no most number who over know water than call first people may down side been now find any
new work part take get place made live where after back little only round man year came show
every good me give our under name very through just form much great think say help low line
before turn cause same mean differ move right boy old too does tell sentence set three want
air well also play small end put home read hand port large spell add even land here must big
high such follow act why ask men change went light kind off need house picture try us again
animal point mother world near build self earth father head stand own page should country found
answer school grow study still learn plant cover food sun four thought let keep eye never last
door between city tree cross since hard start might story saw far sea draw left late run while
press close night real life few stop open seem together next white children begin got walk
example ease paper often always music those both mark book letter until mile river car feet
care second group carry took rain eat room friend began idea fish mountain north once base hear
horse cut sure watch color face wood main enough plain girl usual young ready above ever red list
though feel talk bird soon body dog family direct pose leave song measure state product black
short numeral class wind question happen complete ship area half rock order fire south problem
piece told knew pass farm top whole king size heard best hour better true during hundred am
remember step early hold west ground interest reach fast five sing listen six table travel less
morning ten simple several vowel toward war lay against pattern slow center love person money
serve appear road map science rule govern pull cold notice voice fall power town fine certain fly
unit lead cry dark machine note wait plan figure star box noun field rest correct able pound done
beauty drive stood contain front teach week final gave green oh quick develop sleep warm free
minute strong special mind behind clear tail produce fact street inch lot nothing course stay
wheel full force blue object decide surface deep moon island foot yet busy test record boat common
gold possible plane age dry wonder laugh thousand ago ran check game shape yes miss brought heat
snow bed bring sit perhaps fill east weight language among data model system request response
server cache token prefix query user assistant please explain summarize answer context document
section value result error example function code input output time first question about following
write describe list using based provide information between within without however therefore
because while should would could also other more most many much such
The A I In It This What How You We If When There They He She For On And But Is Are Can Please
Explain Summarize Write Describe List Answer Question Context Document User Assistant System
"""

_VOCAB: tuple[str, ...] = tuple(dict.fromkeys(_WORDS.split()))
_WORD_BASE = _NUM_SPECIAL
_B1 = _WORD_BASE + 2 * len(_VOCAB)
_B2 = _B1 + 256
_B3 = _B2 + 65536
VOCAB_SIZE = _B3 + (1 << 24)
"""One more than the largest id `encode` can return."""

_PIECE_RE = re.compile(
    r"<\|(?:system|user|assistant|tool|end)\|>|</?s>"
    r"| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]|\s"
)

_PIECE_TO_IDS: dict[str, tuple[int, ...]] = {}
_ID_TO_TEXT: dict[int, str] = {}
for _i, _tok in enumerate(SPECIAL_TOKENS):
    _PIECE_TO_IDS[_tok] = (_i,)
    _ID_TO_TEXT[_i] = _tok
for _i, _word in enumerate(_VOCAB):
    _PIECE_TO_IDS[_word] = (_WORD_BASE + 2 * _i,)
    _PIECE_TO_IDS[" " + _word] = (_WORD_BASE + 2 * _i + 1,)
    _ID_TO_TEXT[_WORD_BASE + 2 * _i] = _word
    _ID_TO_TEXT[_WORD_BASE + 2 * _i + 1] = " " + _word
_STATIC_PIECES = len(_PIECE_TO_IDS)
_CACHE_LIMIT = _STATIC_PIECES + 200_000

WORD_IDS: tuple[int, ...] = tuple(_WORD_BASE + 2 * i + 1 for i in range(len(_VOCAB)))
"""Ids of the vocabulary words with a leading space: what random output is made of."""


def _chunk_ids(piece: str) -> tuple[int, ...]:
    data = piece.encode("utf-8")
    out = []
    for start in range(0, len(data), 3):
        chunk = data[start : start + 3]
        value = int.from_bytes(chunk, "big")
        out.append((_B1, _B2, _B3)[len(chunk) - 1] + value)
    return tuple(out)


def _piece_ids(piece: str) -> tuple[int, ...]:
    ids = _chunk_ids(piece)
    if len(_PIECE_TO_IDS) < _CACHE_LIMIT:
        _PIECE_TO_IDS[piece] = ids
    return ids


def encode(text: str) -> list[int]:
    """Token ids of `text` (no BOS is added)."""
    out: list[int] = []
    extend = out.extend
    get = _PIECE_TO_IDS.get
    for piece in _PIECE_RE.findall(text):
        ids = get(piece)
        extend(ids if ids is not None else _piece_ids(piece))
    return out


def token_bytes(token_id: int) -> bytes:
    """The UTF-8 bytes one token stands for (a chunk token may hold part of a character)."""
    text = _ID_TO_TEXT.get(token_id)
    if text is not None:
        return text.encode("utf-8")
    if _B1 <= token_id < _B2:
        return (token_id - _B1).to_bytes(1, "big")
    if _B2 <= token_id < _B3:
        return (token_id - _B2).to_bytes(2, "big")
    if _B3 <= token_id < VOCAB_SIZE:
        return (token_id - _B3).to_bytes(3, "big")
    return b""


def decode(ids: Iterable[int]) -> str:
    """The text of `ids`; exact inverse of `encode` (invalid UTF-8 becomes U+FFFD)."""
    return b"".join(token_bytes(i) for i in ids).decode("utf-8", errors="replace")


def token_text(token_id: int) -> str | None:
    """The text of a special or vocabulary token, None for byte-chunk tokens."""
    return _ID_TO_TEXT.get(token_id)


def message_text(content: Any) -> str:
    """The text of an OpenAI message `content`: a string, None, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping):
                if part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
            elif isinstance(part, str):
                texts.append(part)
        return "\n".join(texts)
    raise ValueError(
        f"message content must be a string or a list of parts, not {type(content).__name__}"
    )


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
) -> str:
    """The prompt text of a chat conversation (see the module docstring)."""
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError("each message must be an object with `role` and `content`")
        role = message.get("role")
        marker = _ROLES.get(role) if isinstance(role, str) else None
        if marker is None:
            raise ValueError(f"unsupported message role {role!r}; use one of {sorted(_ROLES)}")
        parts.append(f"<|{marker}|>\n{message_text(message.get('content'))}<|end|>\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def encode_chat(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    return encode(apply_chat_template(messages, add_generation_prompt))


class Tokenizer(Protocol):
    """What the simulator needs from a tokenizer (built-in or HuggingFace)."""

    name: str
    eos_token_id: int

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: what vLLM does for a completion prompt (True) but not for
        a rendered chat template (False), e.g. prepend BOS."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...

    def output_token_ids(self) -> Sequence[int]:
        """Ids random output is drawn from."""
        ...

    def stream_decoder(self) -> StreamDecoder: ...


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str:
        """Text completed by one more token (may be empty mid-character)."""
        ...


class _BuiltinStreamDecoder:
    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        text = _ID_TO_TEXT.get(token_id)
        if text is not None:
            return text
        return str(self._decoder.decode(token_bytes(token_id)))


class BuiltinTokenizer:
    """The module-level functions behind the `Tokenizer` protocol."""

    name = f"servegate-builtin-v{TOKENIZER_VERSION}"
    eos_token_id = EOS_ID

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return decode(ids)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return apply_chat_template(messages, add_generation_prompt)

    def output_token_ids(self) -> Sequence[int]:
        return WORD_IDS

    def stream_decoder(self) -> StreamDecoder:
        return _BuiltinStreamDecoder()
