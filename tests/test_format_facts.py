"""The contract answers what a merged file's format version stands for: one decoder or two,
cross-attention rows per input, quantized weights. Only contract.py reads the number."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from onnxmerge import contract
from onnxmerge.errors import InvalidMergedModelError

PACKAGE = Path(__file__).resolve().parent.parent / "onnxmerge"
PRECISION = '{"decoder": "int8", "encoder": "fp32"}'

# (metadata, one_decoder, cross_attention_per_input, quantized): each version as written.
FILES = [
    ({contract.META_FORMAT_VERSION: "1"}, False, False, False),
    ({contract.META_FORMAT_VERSION: "2", contract.META_PRECISION: PRECISION}, False, False, True),
    ({contract.META_FORMAT_VERSION: "3"}, True, False, False),
    ({contract.META_FORMAT_VERSION: "3", contract.META_PRECISION: PRECISION}, True, False, True),
    ({contract.META_FORMAT_VERSION: "4"}, True, True, False),
    ({contract.META_FORMAT_VERSION: "4", contract.META_PRECISION: PRECISION}, True, True, True),
]


@pytest.mark.parametrize(("metadata", "one_decoder", "per_input", "quantized"), FILES)
def test_each_version_answers_its_facts_and_is_written_back_as_itself(
    metadata, one_decoder, per_input, quantized
):
    facts = contract.format_of(metadata)
    assert (facts.one_decoder, facts.cross_attention_per_input, facts.quantized) == (
        one_decoder,
        per_input,
        quantized,
    )
    assert facts.version == metadata[contract.META_FORMAT_VERSION]
    assert contract.is_merged(metadata)


@pytest.mark.parametrize(("metadata", "one_decoder", "per_input", "quantized"), FILES)
def test_read_contract_carries_the_facts(metadata, one_decoder, per_input, quantized):
    names = [contract.DECODER_INPUT_IDS, contract.past_name(0, "decoder", "key")]
    info = contract.read_contract(metadata, names, [contract.LOGITS])
    assert (info.one_decoder, info.cross_attention_per_input, info.format.quantized) == (
        one_decoder,
        per_input,
        quantized,
    )
    assert info.format_version == metadata[contract.META_FORMAT_VERSION]


@pytest.mark.parametrize(
    ("version", "changes", "written"),
    [
        ("1", {"quantized": True}, "2"),  # quantize: the two-decoder form becomes version 2
        ("3", {"quantized": True}, "3"),  # the one-decoder forms keep their number
        ("4", {"quantized": True}, "4"),
        ("3", {"cross_attention_per_input": True}, "4"),  # the merge's per-input rewrite
    ],
)
def test_recording_a_change_writes_the_version_of_the_new_facts(version, changes, written):
    metadata = {contract.META_FORMAT_VERSION: version, contract.META_LAYOUT: "with_past"}
    facts = contract.record_format(metadata, **changes)
    assert metadata == {contract.META_FORMAT_VERSION: written, contract.META_LAYOUT: "with_past"}
    assert list(metadata) == [contract.META_FORMAT_VERSION, contract.META_LAYOUT]  # key order kept
    assert all(getattr(facts, fact) == value for fact, value in changes.items())


def test_per_input_rows_without_one_decoder_are_refused():
    with pytest.raises(ValueError, match="one-decoder form only"):
        contract.FormatFacts(cross_attention_per_input=True)


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({}, "not a merged model: merge its export folder first"),
        ({contract.META_GENERATOR: "{}"}, "is a generator model"),
        (
            {contract.META_FORMAT_VERSION: "5"},
            "version 5, this onnxmerge reads versions 1, 2, 3, 4",
        ),
    ],
)
def test_a_file_that_declares_no_readable_format_is_refused(metadata, match):
    assert contract.is_merged(metadata) == (contract.META_FORMAT_VERSION in metadata)
    with pytest.raises(InvalidMergedModelError, match=match):
        contract.format_of(metadata, "model.onnx")
    with pytest.raises(InvalidMergedModelError, match=match):
        contract.read_contract(metadata, [contract.DECODER_INPUT_IDS], [contract.LOGITS])


# The merged metadata is first written by the splice; a generator drops the key (it is no
# merged model). Nothing else names the key or a version number.
WRITERS = {"merge/_splice.py", "generator/_build.py"}


def test_only_the_contract_reads_the_version_number():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "contract.py" or where.startswith("testing/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), where)):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if isinstance(node, ast.alias):
                name = node.name
            if not name or "FORMAT_VERSION" not in name:
                continue
            if name == "META_FORMAT_VERSION" and where in WRITERS:
                continue
            found.append(f"{where}:{getattr(node, 'lineno', '?')} {name}")
    assert found == []
