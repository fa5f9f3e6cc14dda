"""Environment and data that run a test over mutual TLS with //tools:test_certs."""

TLS_ENV = {
    "DDPRPC_TLS_CA": "$(rootpath //tools:test_certs/ca.pem)",
    "DDPRPC_TLS_CERT": "$(rootpath //tools:test_certs/127.0.0.1.pem)",
    "DDPRPC_TLS_KEY": "$(rootpath //tools:test_certs/127.0.0.1.key)",
}

TLS_DATA = [
    "//tools:test_certs/ca.pem",
    "//tools:test_certs/127.0.0.1.pem",
    "//tools:test_certs/127.0.0.1.key",
]
