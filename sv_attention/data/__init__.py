"""Training data: the embedded story corpus and byte-level loading through ``datasets``."""

from sv_attention.data.corpus import DEFAULT_EMBEDDED_BYTES, EmbeddedCorpus, embedded_corpus
from sv_attention.data.loading import ByteCorpus, CorpusSplit, load_corpus, split_contiguous
from sv_attention.data.stories import GENERATOR_VERSION, generate_stories, iter_stories

__all__ = [
    "DEFAULT_EMBEDDED_BYTES", "EmbeddedCorpus", "embedded_corpus", "ByteCorpus", "CorpusSplit", "load_corpus",
    "split_contiguous", "GENERATOR_VERSION", "generate_stories", "iter_stories",
]
