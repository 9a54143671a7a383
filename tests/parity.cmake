# Parity tests (label `parity`): every vendored golden case (tests/data/*.json) of a kind posenc-run
# knows runs through `posenc-run --check` in double and in float, plus --threads 2 for the kinds that
# run the attention kernel and the extra variants a kind lists (hf_float32 for rope); docs/parity.md.
#
# The kinds have one registry, the table in tools/posenc_run.cpp, printed by `posenc-run --list-kinds`.
# posenc-run exists only after the build, so these tests are generated when ctest runs, not here:
# tests/parity_tests.cmake is a TEST_INCLUDE_FILES script (the mechanism of gtest_discover_tests'
# PRE_TEST mode) that asks posenc-run for its kinds and reads each case's `kind`. A new family joins by
# its runner and table row in posenc-run and its cases in tests/data: nothing to edit here.
if(NOT POSENC_BUILD_TOOLS)
  message(STATUS "posenc: POSENC_BUILD_TOOLS is OFF: no posenc-run, so no parity tests")
  return()
endif()

set(_posenc_parity_setup "
set(POSENC_RUN [==[$<TARGET_FILE:posenc-run>]==])
set(POSENC_PARITY_DATA [==[${CMAKE_CURRENT_SOURCE_DIR}/data]==])
include([==[${CMAKE_CURRENT_SOURCE_DIR}/parity_tests.cmake]==])
")
get_property(_multi_config GLOBAL PROPERTY GENERATOR_IS_MULTI_CONFIG)
if(_multi_config)
  # One generated file per configuration; ctest -C <config> picks one.
  file(GENERATE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/posenc_parity_$<CONFIG>.cmake CONTENT "${_posenc_parity_setup}")
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/posenc_parity.cmake
       "include(\"${CMAKE_CURRENT_BINARY_DIR}/posenc_parity_\${CTEST_CONFIGURATION_TYPE}.cmake\")\n")
else()
  file(GENERATE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/posenc_parity.cmake CONTENT "${_posenc_parity_setup}")
endif()
set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${CMAKE_CURRENT_BINARY_DIR}/posenc_parity.cmake)

# posenc_parity_must_fail(<name> <case file> <regex>): posenc-run --check on the case must print a
# line matching <regex> (test parity.<name>) and exit non-zero (test parity.<name>_exit_status).
function(posenc_parity_must_fail name file regex)
  if(NOT EXISTS ${file})
    message(FATAL_ERROR "posenc: the parity self-test case ${file} is missing")
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

# A parameter the attention kind does not know is refused, never ignored, and so is a kv_dtype that is
# not one of FORMAT.md 5.11's storage types.
posenc_parity_must_fail(attention_refuses_unknown_param
                        ${CMAKE_CURRENT_SOURCE_DIR}/data/parity_selftest/selftest_attention_unknown_param.json
                        "params.no_such_param: is not a parameter of kind attention")
# Every kind refuses a parameter it does not define: a misspelt rope_theta would run with the default.
posenc_parity_must_fail(rope_attention_refuses_misspelt_param
                        ${CMAKE_CURRENT_SOURCE_DIR}/data/parity_selftest/selftest_rope_attention_misspelt_param.json
                        "params.rope_thetta: is not a parameter of kind rope_attention")
posenc_parity_must_fail(attention_refuses_unknown_kv_dtype
                        ${CMAKE_CURRENT_SOURCE_DIR}/data/parity_selftest/selftest_attention_kv_dtype.json
                        "params.kv_dtype: must be f16 or bf16")

# posenc-run must be able to fail: the same tensors as alibi_8_heads_causal_prefill with an
# impossible tolerance on `out` (tests/data/parity_selftest/) must be reported and exit 1.
posenc_parity_must_fail(selftest_reports_mismatch
                        ${CMAKE_CURRENT_SOURCE_DIR}/data/parity_selftest/selftest_alibi_impossible_tolerance.json
                        "out +F64 .*FAIL: [0-9]+ elements beyond")

# The registry itself: --list-kinds prints one well-formed row per kind, among them the ones above.
add_test(NAME parity.list_kinds COMMAND posenc-run --list-kinds)
set_tests_properties(parity.list_kinds PROPERTIES LABELS parity
                     PASS_REGULAR_EXPRESSION "(^|\n)alibi +attention +-\n"
                     FAIL_REGULAR_EXPRESSION "(^|\n)[^ \n]+ +[^ \n]+\n")
