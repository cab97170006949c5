"""Running code this project has never seen: tools a policy calls mid-response, and (the same
guarantees) user reward code. A floor of its own beside `contracts`: it imports nothing from the
project, so every stage may import it (`rollout` runs tools with it).

`sandbox.pool.Sandbox` keeps worker processes that each load one function (`module:function`)
and call it on strings, one call at a time, under a wall-clock limit the parent enforces.
`sandbox.worker` is what runs in them; `sandbox.frames` is their wire format;
`sandbox.builtin_tools` holds the tools that ship with the project (a calculator, Python).
"""
