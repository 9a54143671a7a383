# Parity tests (label `parity`): every vendored golden case of a kind posenc-run knows runs through
# `posenc-run --check` in double and in float (docs/parity.md). Cases are found by reading the `kind`
# of each tests/data/*.json, so a newly vendored case of a supported kind is picked up by a re-run of
# cmake; a new family joins by adding its kind to POSENC_PARITY_KINDS (and its runner to posenc-run).
if(NOT TARGET posenc-run)
  message(STATUS "posenc: posenc-run is not built, parity tests skipped")
  return()
endif()

set(POSENC_PARITY_KINDS sinusoidal rope rope_attention alibi t5 shaw transformer_xl attention tupe deberta
    deberta_buckets)
set(_attention_kinds rope_attention alibi t5 shaw transformer_xl attention tupe deberta)

file(GLOB _cases CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/data/*.json)
set(_count 0)
foreach(_case IN LISTS _cases)
  file(READ ${_case} _text)
  string(JSON _kind ERROR_VARIABLE _err GET "${_text}" kind)
  if(_err OR NOT _kind IN_LIST POSENC_PARITY_KINDS)
    continue()
  endif()
  get_filename_component(_name ${_case} NAME_WE)
  # NAME_WE stops at the first dot (rope_partial_0.4_...): take the stem instead.
  string(REGEX REPLACE "\\.json$" "" _name "${_case}")
  get_filename_component(_name ${_name} NAME)
  math(EXPR _count "${_count} + 1")
  foreach(_dtype f64 f32)
    add_test(NAME parity.${_name}.${_dtype} COMMAND posenc-run --check --dtype ${_dtype} ${_case})
    set_tests_properties(parity.${_name}.${_dtype} PROPERTIES LABELS parity)
  endforeach()
  # The HF float32 emulation (compares the *_hf_float32 expectations) and the threaded kernel path.
  if(_kind STREQUAL "rope")
    add_test(NAME parity.${_name}.hf_float32 COMMAND posenc-run --check --dtype f32 --rope-angles hf_float32 ${_case})
    set_tests_properties(parity.${_name}.hf_float32 PROPERTIES LABELS parity)
  endif()
  if(_kind IN_LIST _attention_kinds)
    add_test(NAME parity.${_name}.threads2 COMMAND posenc-run --check --threads 2 ${_case})
    set_tests_properties(parity.${_name}.threads2 PROPERTIES LABELS parity)
  endif()
endforeach()
message(STATUS "posenc: ${_count} golden cases registered for parity")

# posenc_parity_must_fail(<name> <case file> <regex>): posenc-run --check on the case must print a
# line matching <regex> (test parity.<name>) and exit non-zero (test parity.<name>_exit_status).
function(posenc_parity_must_fail name file regex)
  if(NOT EXISTS ${file})
    return()
  endif()
  add_test(NAME parity.${name} COMMAND posenc-run --check ${file})
  set_tests_properties(parity.${name} PROPERTIES LABELS parity PASS_REGULAR_EXPRESSION "${regex}")
  add_test(NAME parity.${name}_exit_status COMMAND posenc-run --check ${file})
  set_tests_properties(parity.${name}_exit_status PROPERTIES LABELS parity WILL_FAIL TRUE)
endfunction()

# A kind posenc-run does not know must fail with a message naming it.
posenc_parity_must_fail(unknown_kind_is_named
                        ${CMAKE_CURRENT_SOURCE_DIR}/data/parity_selftest/selftest_unknown_kind.json
                        "unknown kind 'selftest_no_such_kind'")

# posenc-run must be able to fail: the same tensors as alibi_8_heads_causal_prefill with an
# impossible tolerance on `out` (tests/data/parity_selftest/) must be reported and exit 1.
posenc_parity_must_fail(selftest_reports_mismatch
                        ${CMAKE_CURRENT_SOURCE_DIR}/data/parity_selftest/selftest_alibi_impossible_tolerance.json
                        "out +F64 .*FAIL: [0-9]+ elements beyond")
