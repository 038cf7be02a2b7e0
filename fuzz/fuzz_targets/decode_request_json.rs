//! A generation request body in JSON, as `gen.submit.<pool>` and the queue receive it.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    genfleet_fuzz::check_request(genfleet::protocol::Encoding::Json, data);
});
