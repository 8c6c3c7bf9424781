"""Generated protobuf and gRPC modules (``make proto`` / ``python -m retina_common.codegen``).

The ``.proto`` sources live in ``proto/retina_common/pb/`` so that the generated
modules import each other as ``retina_common.pb.*``.
"""
