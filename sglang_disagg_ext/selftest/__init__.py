"""The self-test rig: real transfers prefill -> decode through SGLang's own
managers and engines, with every destination byte checked.

``runner`` is ``sglang-disagg-ext selftest``; ``harness`` starts the prefill and
decode worker processes; ``scenarios`` holds one module per fix family. The
plugin's runtime (``core``, ``backends``, ``registration``) never imports this
package.
"""
