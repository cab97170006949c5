"""A reward module that cannot be imported: its `reward.function` must fail at start."""

raise RuntimeError("this module needs a GPU")
