"""Incremental detokenization: the text of a sequence's output grows with each token.

Only the last few tokens are re-decoded each step (their text can change while a multi-byte
character or a merge is incomplete), so the cost per step is constant.
"""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0  # start of the tokens decoded again for context
        self.read_offset = 0    # tokens up to here are already in the text

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, output_ids: list[int]) -> str:
        """Text that the newest token(s) add, '' while a character is still incomplete."""
        if self.tokenizer is None:
            return ""
        prefix_text = self.decode(output_ids[self.prefix_offset:self.read_offset])
        new_text = self.decode(output_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        return new_text[len(prefix_text):]
