"""Training data.

- ``sampler.py``  the exactly-once elastic sampler: a global cursor that advances on commit
- ``text.py``     ``[train.data]`` for Hugging Face models: :func:`load_text_data`, :class:`TextData`
- ``formats.py``  which files, in which format and order (text, JSON, Parquet, Arrow, save_to_disk)
- ``tokenize.py`` rows into pretraining token streams and SFT samples, bad rows counted
- ``cache.py``    the tokenization cache: one entry per key, built once under a lock
"""
