"""What a run needs prepared before anything starts: the prompt files (synthetic, reasoning-gym,
or fetched from the Hub), the tiny base model of the demo, and `dapo data inspect`'s view of what
a run would read from a file."""
