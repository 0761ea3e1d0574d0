package devcluster

import (
	"fmt"
	"os"
	"sync"

	"k8s.io/klog/v2"
)

// processTB lets the API server's test harness run outside `go test` (the
// demo binary). It logs through klog, turns fatal calls into a panic that
// Start recovers, and runs cleanups in reverse order at Stop.
type processTB struct {
	name string

	mu       sync.Mutex
	cleanups []func()
	failed   bool
	tempDirs []string
}

// fatalError is what processTB panics with on Fatal; Start turns it back
// into an error.
type fatalError struct{ msg string }

func (t *processTB) Attr(string, string)       {}
func (t *processTB) Chdir(string)              { panic(fatalError{"Chdir is not supported outside tests"}) }
func (t *processTB) Error(args ...any)         { t.Log(args...); t.Fail() }
func (t *processTB) Errorf(f string, a ...any) { t.Logf(f, a...); t.Fail() }
func (t *processTB) Fail()                     { t.mu.Lock(); t.failed = true; t.mu.Unlock() }
func (t *processTB) FailNow()                  { t.Fail(); panic(fatalError{"FailNow"}) }
func (t *processTB) Failed() bool              { t.mu.Lock(); defer t.mu.Unlock(); return t.failed }
func (t *processTB) Fatal(args ...any)         { t.Fail(); panic(fatalError{fmt.Sprint(args...)}) }
func (t *processTB) Fatalf(f string, a ...any) { t.Fail(); panic(fatalError{fmt.Sprintf(f, a...)}) }
func (t *processTB) Helper()                   {}
func (t *processTB) Log(args ...any)           { klog.V(4).InfoDepth(1, fmt.Sprint(args...)) }
func (t *processTB) Logf(f string, a ...any)   { klog.V(4).InfoDepth(1, fmt.Sprintf(f, a...)) }
func (t *processTB) Name() string              { return t.name }
func (t *processTB) Setenv(k, v string)        { _ = os.Setenv(k, v) }
func (t *processTB) Skip(args ...any)          { panic(fatalError{"Skip: " + fmt.Sprint(args...)}) }
func (t *processTB) Skipf(f string, a ...any)  { panic(fatalError{"Skip: " + fmt.Sprintf(f, a...)}) }
func (t *processTB) SkipNow()                  { panic(fatalError{"SkipNow"}) }
func (t *processTB) Skipped() bool             { return false }

func (t *processTB) Cleanup(f func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cleanups = append(t.cleanups, f)
}

func (t *processTB) TempDir() string {
	dir, err := os.MkdirTemp("", "devcluster-")
	if err != nil {
		t.Fatalf("TempDir: %v", err)
	}
	t.mu.Lock()
	t.tempDirs = append(t.tempDirs, dir)
	t.mu.Unlock()
	return dir
}

// runCleanups runs the registered cleanups, last first, as testing does.
func (t *processTB) runCleanups() {
	t.mu.Lock()
	cleanups, dirs := t.cleanups, t.tempDirs
	t.cleanups, t.tempDirs = nil, nil
	t.mu.Unlock()
	for i := len(cleanups) - 1; i >= 0; i-- {
		cleanups[i]()
	}
	for _, d := range dirs {
		_ = os.RemoveAll(d)
	}
}
