"""Which weight format each role of a model is held in: the :class:`FormatPlan`.

Roles (a weight's role follows from where it sits in a shard, see :func:`role_of`):

- ``experts``: every feed-forward weight: routed expert banks, shared experts, dense MLP layers.
- ``attention``: the attention projections (q, k, v, o and MLA's down/up projections, except
  the ones a layer reads directly, such as DeepSeek's ``kv_b_proj``, which stay plain).
- ``head``: the output projection to the vocabulary.
- ``embeddings``: the token embedding table [vocab, hidden]. A lookup decodes only the rows of
  the ids asked for (:meth:`~engine.formats.QuantizedWeight.rows`), so it takes every format the
  experts take. A head tied to embeddings in a packed format (``tie_word_embeddings``) is that
  same weight: held once, in the embeddings' format (the ``head`` format is then unused).

Everything else (norms, routers, biases, attention sinks) is ``other`` and stays in the compute
dtype. A role's format ``None`` means "as stored": the compute dtype, or a checkpoint's own
packed format (GPT-OSS MXFP4 experts).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..format_names import MATMUL_FORMATS, PACKED_FORMATS, PLAIN_FORMATS, ROLE_FORMATS, ROLES
from .base import FormatError
from .registry import check_format

OTHER = "other"  # norms, routers, biases, sinks: never quantized

# the vocabulary's lists (engine.format_names), under the names this module has always used
PLAIN, PACKED, MATMUL, SUPPORTED = PLAIN_FORMATS, PACKED_FORMATS, MATMUL_FORMATS, ROLE_FORMATS


@dataclass(frozen=True)
class FormatPlan:
    """A format name per role, or None to keep the role as stored. Validated when built."""

    experts: str | None = None
    attention: str | None = None
    head: str | None = None
    embeddings: str | None = None

    def __post_init__(self) -> None:
        for role in ROLES:
            name = getattr(self, role)
            if name is None:
                continue
            check_format(name)
            if name not in SUPPORTED[role]:
                raise FormatError(
                    f"format {name!r} is not supported for {role}; {role} supports {', '.join(SUPPORTED[role])}"
                )

    @classmethod
    def default(cls, **overrides: str | None) -> FormatPlan:
        """The plan when quantization is asked for: int4 experts, int8 attention and head,
        embeddings as stored; ``overrides`` replace single roles."""
        unknown = sorted(set(overrides) - set(ROLES))
        if unknown:
            raise FormatError(f"unknown role(s) {unknown}; roles are {', '.join(ROLES)}")
        return cls(**{**dict(experts="int4", attention="int8", head="int8", embeddings=None), **overrides})

    def format_for(self, role: str) -> str | None:
        return getattr(self, role) if role in ROLES else None

    @property
    def packed_embeddings(self) -> bool:
        """Whether the embedding table is held in a packed format (and a tied head with it)."""
        return self.embeddings in PACKED

    def to_json(self) -> dict[str, str | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: object) -> FormatPlan:
        if not isinstance(data, dict) or set(data) - set(ROLES):
            raise FormatError(f"a format plan is an object with keys among {', '.join(ROLES)}, got {data!r}")
        return cls(**data)

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, role) is None for role in ROLES)


def role_of(path: str) -> str:
    """The role of a module or tensor at ``path`` inside a shard (``layers.3.mlp.experts``,
    ``head``, ``embed``)."""
    parts = path.split(".")
    if parts[0] == "embed":
        return "embeddings"
    if parts[0] == "head":
        return "head"
    if parts[0] != "layers" or len(parts) < 3:
        return OTHER
    block = parts[2]
    if any("norm" in part for part in parts[3:]) or parts[-1] == "sinks":
        return OTHER
    if block == "attention":
        return "attention"
    if block == "mlp" and not (len(parts) > 3 and parts[3] in ("router_proj", "route")):
        return "experts"
    return OTHER


KEEP = "none"  # the command-line word for "as stored"


def plan_from_options(quantize: bool, **roles: str | None) -> FormatPlan | None:
    """The plan the command line asks for: None when neither ``quantize`` nor any role is given;
    otherwise the defaults with each given role replaced (``"none"`` keeps a role as stored)."""
    given = {role: name for role, name in roles.items() if name is not None}
    if not quantize and not given:
        return None
    return FormatPlan.default(**{role: None if name == KEEP else name for role, name in given.items()})
