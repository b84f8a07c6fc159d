"""The request bodies of ``qkv serve``, as pydantic models: a field of the wrong type, a field
the endpoint does not know or a value out of range is refused with 422 before any model runs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qkv.decoding.sampling import MIN_TEMPERATURE

MODEL_HELP = "the model's name (GET /models); may be left out when one model serves the endpoint"


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # NaN: "should be a finite number"

    model: str | None = Field(None, description=MODEL_HELP)


class TranslateRequest(Request):
    texts: list[str] = Field(min_length=1, description="source sentences", examples=[["three hundred twenty-one"]])
    beam_size: int | None = Field(None, ge=1, description="beam size (1: greedy; default: the model's own)")
    n_best: int = Field(1, ge=1, description="hypotheses per sentence, best first (at most beam_size)")
    target_prefix: str | None = Field(None, description="every translation starts with this target text")
    alignments: bool = Field(False, description="add each hypothesis's alignment in Pharaoh i-j form")
    attention: bool = Field(False, description="add the cross-attention weights of every layer and head "
                                               "([layer][head][target token][source token])")


class ScoreRequest(Request):
    sources: list[str] = Field(min_length=1, description="source sentences")
    targets: list[str] = Field(min_length=1, description="their translations to score, as many as sources")


class ClassifyRequest(Request):
    texts: list[str] = Field(min_length=1, description="texts to label")


class EmbedRequest(Request):
    texts: list[str] = Field(min_length=1, description="texts to embed", examples=[["a dog runs on the beach"]])
    pooling: Literal["mean", "cls"] | None = Field(
        None, description="mean over the real tokens or the <cls> state (default: the model's own; an imported "
                          "sentence-transformers model's pooling)")


class FillRequest(Request):
    texts: list[str] = Field(min_length=1, description="texts with [MASK] pieces")
    k: int = Field(5, ge=1, le=100, description="predictions per [MASK]")


class GenerateRequest(Request):
    prefix: str = Field(description="the text to continue", examples=["the time traveller"])
    max_new_tokens: int = Field(100, ge=1, description="tokens to generate")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0: greedy; 1: the model's distribution")
    top_k: int = Field(0, ge=0, description="sample among the k most probable tokens (0: all)")
    top_p: float = Field(1.0, ge=1e-6, le=1.0, description="nucleus sampling: the smallest set with this mass")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="random seed (the same seed, the same text)")
    stream: bool = Field(False, description="answer as a text/event-stream, one event per piece of text")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:  # the sampler's own bound, refused before any work
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        return v


__all__ = ["TranslateRequest", "ScoreRequest", "ClassifyRequest", "FillRequest", "GenerateRequest"]
