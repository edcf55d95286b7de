"""Decoding written once against the model API: greedy and beam search, a corpus in batches, a trained run
loaded, translate, CTranslate2 export and engine."""
