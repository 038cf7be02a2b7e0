//! A generation request body in MessagePack (`Content-Type: application/msgpack`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    genfleet_fuzz::check_request(genfleet::protocol::Encoding::MsgPack, data);
});
