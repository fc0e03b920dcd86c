"""A cache folder that cannot be written is one line naming it, what it holds and how
to move it (issue 28 item 7). The driver's and the preprocessor's runs with a
read-only HOME: tests/training/test_data_mistakes.py."""
import pytest

from megatron_sdp4bit.data.cache import CacheFolderError, check_writable
from megatron_sdp4bit.data.corpus import prepare_default_corpus


@pytest.fixture
def blocked(tmp_path):
    """A folder path under a regular file: no process can create it (root included)."""
    (tmp_path / "file").write_text("x")
    return str(tmp_path / "file" / "cache")


def test_the_default_names_sdp4bit_cache(blocked):
    with pytest.raises(CacheFolderError) as error:
        check_writable(blocked)
    assert str(error.value) == (f"cannot write {blocked} (Not a directory): it is megatron_sdp4bit's cache of the "
                                "embedded corpus, its tokenizer and the dataset index files; set SDP4BIT_CACHE to "
                                "a writable folder (e.g. SDP4BIT_CACHE=/tmp/sdp4bit-cache)")


def test_a_folder_from_a_flag_names_the_flag(blocked, tmp_path):
    with pytest.raises(CacheFolderError, match=r"cache of the dataset index files; pass a writable --data-cache-path$"):
        check_writable(blocked, "the dataset index files", "--data-cache-path")
    with pytest.raises(CacheFolderError, match=r"cannot write .*file.*; pass a writable --cache-dir$"):
        prepare_default_corpus(cache_dir=blocked, max_mb=1)
    assert check_writable(str(tmp_path / "new" / "folder")) == str(tmp_path / "new" / "folder")
